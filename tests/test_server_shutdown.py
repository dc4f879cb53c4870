"""The server's shutdown and overload behaviour (k3jax/serving/api.py Drain, server.run_server): SIGTERM
with streams in flight drains (new requests 503, the streams that finish in time end normally, the one
left at the deadline ends with finish_reason "abort" and [DONE], the process exits); a stream whose
client stops reading is cancelled after the idle timeout, freeing its row; a body over the limit is
413 before it is read whole, and the server answers afterwards. The engine is scripted (a token every
STEP_S seconds), so no model runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from k3jax.tokenizer import ByteTokenizer
from k3jax.serving.api import create_app
from k3jax.serving.metrics import Metrics
from cpu_devices import TESTS, free_port
from test_serving import client, post, running_server, wait_until_serving

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEP_S = 0.02


class SlowEngine:
    """The engine's client side; each request "generates" byte ``a`` every STEP_S seconds in a thread of
    its own until ``max_tokens`` or a cancel (which ends it with the cancel's reason)."""

    max_len, max_batch, max_queue = 100_000, 8, 8

    def __init__(self):
        self.vocab_size, self.metrics, self.seqs = 256, Metrics(), []

    def start(self):
        pass

    def stop(self):
        pass

    def submit(self, seq):
        self.seqs.append(seq)

        def run():
            for _ in range(seq.params.max_tokens):
                time.sleep(STEP_S)
                if seq.cancelled:
                    break
                seq.generated.append(ord("a"))
                seq.on_token(ord("a"), None)
            seq.finish_reason = seq.cancelled or "length"
            seq.on_finish(seq.finish_reason)
        threading.Thread(target=run, daemon=True).start()

    def cancel(self, seq, reason="cancelled"):
        seq.cancelled = seq.cancelled or reason

    def active_count(self):
        return sum(s.finish_reason is None for s in self.seqs)

    def queue_length(self):
        return 0


def _request(path: str, body: bytes):
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80)}


def test_stalled_stream_is_cancelled_after_the_idle_timeout():
    """A client that stops reading after the first chunk (its sends never complete): the request is
    cancelled within the timeout, well before its max_tokens, and the response ends."""
    engine = SlowEngine()
    app = create_app(engine, ByteTokenizer(), "tiny", idle_timeout_s=0.3)
    body = json.dumps({"prompt": "hi", "max_tokens": 5000, "stream": True}).encode()

    async def scenario():
        sent, stalled = [], asyncio.Event()

        async def receive():
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                stalled.set()
                await asyncio.Event().wait()  # a full socket: the send never completes

        t0 = time.monotonic()
        await asyncio.wait_for(app(_request("/v1/completions", body), receive, send), 10)
        took = time.monotonic() - t0
        while engine.seqs[0].finish_reason is None and time.monotonic() < t0 + 10:  # the engine lets it go
            await asyncio.sleep(0.01)
        return took, stalled.is_set()

    took, stalled = asyncio.run(scenario())
    (seq,) = engine.seqs
    assert stalled and took < 3 and seq.finish_reason == "cancelled" and len(seq.generated) < 500


def test_oversized_body_is_413_before_it_is_read():
    engine = SlowEngine()
    with running_server(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:  # declares 32 MiB, sends 10 bytes
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 33554432\r\n\r\n{\"prompt\":")
            head = s.recv(65536).decode()
        assert head.startswith("HTTP/1.1 413") and "payload_too_large" in head
        status, reply, _ = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})  # still serving
        assert status == 200 and reply["choices"][0]["text"] == "aaa"
    # a body without a length (chunked) stops being read once past the limit
    app = create_app(SlowEngine(), ByteTokenizer(), "tiny", max_body_bytes=1000)

    async def chunked():
        reads, out = [], []

        async def receive():
            reads.append(1)
            return {"type": "http.request", "body": b" " * 600, "more_body": True}

        async def send(message):
            out.append(message)
        await app(_request("/v1/completions", b""), receive, send)
        return len(reads), out[0]["status"]
    assert asyncio.run(chunked()) == (2, 413)


@pytest.mark.slow  # a server subprocess (its imports: ~10-30 s)
def test_sigterm_drains_streams_in_flight():
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(map(str, (ROOT, TESTS)))}
    proc = subprocess.Popen([sys.executable, "-m", "children.slow_server", str(port)], env=env,  # tests/children/
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, timeout_s=120, poll_s=0.2)
        started = threading.Barrier(4)

        def stream(max_tokens):
            text, reason = "", None
            for i, chunk in enumerate(client(url).completions.create(model="tiny", prompt="hi", max_tokens=max_tokens,
                                                                     temperature=0, stream=True)):
                if i == 0:
                    started.wait(30)
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            # two finish within the drain's 1.5 s (0.4 s of tokens after the signal), one runs past it
            jobs = [pool.submit(stream, n) for n in (25, 25, 5000)]
            started.wait(30)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            status, reply, headers = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            results = [j.result(timeout=30) for j in jobs]
        assert status == 503 and reply["error"]["type"] == "server_shutting_down" and headers["Retry-After"]
        assert results[0] == ("a" * 25, "length") and results[1] == ("a" * 25, "length")
        text, reason = results[2]
        assert reason == "abort" and 0 < len(text) < 5000
        proc.wait(30)
        assert time.monotonic() - t0 < 20
        assert proc.returncode in (0, -signal.SIGTERM), proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
