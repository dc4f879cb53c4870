"""Resident memory around a streaming ``from_hf`` load in a fresh process (a clean peak-RSS figure): a JSON
line with the RSS before, at the peak (sampled every 2 ms), with the model loaded and after it is freed, and
the model's bytes. Run by ``tests/test_hf_interop.py``; argv: the checkpoint directory."""

import json
import sys
import threading
import time

import jax
from flax import nnx

from k3jax.interop import from_hf


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main(path: str) -> None:
    jax.numpy.zeros(1).block_until_ready()
    base, peak, done = rss(), [0], [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    m = from_hf(path)
    leaves = jax.tree.leaves(nnx.state(m))
    jax.block_until_ready(leaves)
    done[0] = True
    th.join()
    loaded = rss()
    size = sum(x.nbytes for x in leaves)
    del m, leaves
    print(json.dumps({"base": base, "peak": max(peak[0], loaded), "loaded": loaded, "freed": rss(),
                      "model_bytes": size}))


if __name__ == "__main__":
    main(sys.argv[1])
