"""``run_server`` (``infer.py --serve``'s) of ``tests/test_server_shutdown.py``'s slow engine on 127.0.0.1, for
the SIGTERM drain test. Run by ``tests/test_server_shutdown.py``; argv: the port."""

import sys

from k3jax.serving.server import run_server
from k3jax.tokenizer import ByteTokenizer
from test_server_shutdown import SlowEngine


def main(port: int) -> None:
    run_server(SlowEngine(), ByteTokenizer(), "tiny", host="127.0.0.1", port=port, drain_timeout_s=1.5,
               idle_timeout_s=60, max_body_bytes=2**20, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]))
