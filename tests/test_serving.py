"""The OpenAI-compatible server (k3jax/serving) on a real uvicorn server on 127.0.0.1, talked to with
the ``openai`` client: concurrent greedy requests == each request alone through ``k3jax.generate``;
a client leaving mid-stream frees its row without disturbing the others; bad input -> 400 naming
the field while the server keeps serving; no compile as requests come and go; a profile of the next
engine steps (POST /start_profile); the same on 4 fake CPU devices (a subprocess). Also the pieces: moving cache slots, per-row sampling, stop strings."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_devices import free_port, run_child, subprocess_env
from k3jax import create_model, generate, load_config
from k3jax.cache import first_rows, put_first_rows, shift_slots, write_row
from k3jax.tokenizer import ByteTokenizer
from k3jax.inference.sampling import sample_logits
from k3jax.serving.engine import Engine
from k3jax.serving.profiling import StepProfiler
from k3jax.serving.sampling import sample_rows
from k3jax.serving.text import TextStream

pytestmark = pytest.mark.usefixtures("fast_xla")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# KDA (dense FFN), KDA, KDA, MLA, MLA: both mixers and their caches, a scanned pair of groups is not
# needed; max_seq_len bounds the context of the test server.
OVERRIDES = ["model.num_layers=5", "model.max_seq_len=64", "train.seq_len=32", "model.init_std=0.1"]
MAX_LEN, MAX_BATCH, CHUNK = 48, 4, 8
REF_T, REF_NEW = 32, 16  # the reference's padded prompt width and tokens: one compile for all prompts


# --- a server in a thread or a subprocess ---------------------------------------------------------------------------


def wait_until_serving(proc: subprocess.Popen, url: str, *, timeout_s: float, poll_s: float = 0.5) -> None:
    """Wait for a server subprocess (stdout piped) to answer ``/health``; fail with its output if it exits
    or does not come up within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return
        except OSError:
            time.sleep(poll_s)


@contextlib.contextmanager
def running_server(engine: Engine, model_name: str = "tiny", tokenizer=None, **options):
    """A uvicorn server of ``engine`` (with ``tokenizer``, default bytes; ``options``: create_app's) on
    127.0.0.1 (free port) in a thread; yields the base URL."""
    import uvicorn

    from k3jax.serving.api import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, tokenizer or ByteTokenizer(), model_name, **options)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, path: str, body) -> tuple[int, dict, dict]:
    """Raw POST (bytes or a JSON-able object) -> (status, JSON body, headers (case-insensitive))."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def metric(url: str, name: str, default: float | None = None) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    m = re.search(rf"^k3jax_{re.escape(name)} (\S+)$", text, re.M)
    assert m or default is not None, f"{name} not in /metrics"
    return float(m.group(1)) if m else default


# --- checks shared by the one-device and the 4-device runs ---------------------------------------------
def prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.arange(1, REF_T + 1))[:n]  # different lengths, 1..32 (several chunks)
    return [rng.integers(0, 256, int(k)).tolist() for k in lengths]


def reference(model, prompt: list[int]) -> list[int]:
    """``prompt`` alone (a batch of one) through ``k3jax.generate``, greedy, REF_NEW tokens."""
    padded = np.zeros((1, REF_T), np.int32)
    padded[0, :len(prompt)] = prompt
    out = np.asarray(generate(model, padded, REF_NEW, prompt_lengths=[len(prompt)]))
    return out[0, len(prompt):len(prompt) + REF_NEW].tolist()


def completion(url: str, prompt: list[int], max_tokens: int, stream: bool) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of a greedy completion through the openai client."""
    c = client(url)
    extra = {"return_token_ids": True}
    if not stream:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
        return r.choices[0].token_ids, r.choices[0].text, r.choices[0].finish_reason
    ids, text, reason = [], "", None
    for chunk in c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      stream=True, extra_body=extra):
        choice = chunk.choices[0]
        ids += getattr(choice, "token_ids", None) or []
        text += choice.text
        reason = choice.finish_reason or reason
    return ids, text, reason


def check_concurrent_equals_alone(url: str, model, n: int = 10, seed: int = 0):
    """n concurrent greedy requests (different prompt lengths and max_tokens, half of them streamed,
    more than the pool has rows) == each prompt alone through generate."""
    ps = prompts(seed, n)
    max_tokens = [REF_NEW - (i % 5) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(completion, url, p, m, i % 2 == 1) for i, (p, m) in enumerate(zip(ps, max_tokens))]
        results = [f.result() for f in futures]
    refs = [reference(model, p) for p in ps]
    assert len({tuple(r) for r in refs}) > n // 2, "the reference continuations barely depend on the prompt"
    tok = ByteTokenizer()
    for (ids, text, reason), ref, m in zip(results, refs, max_tokens):
        assert ids == ref[:m]
        assert text == tok.decode(ref[:m])
        assert reason == "length"


BAD_INPUTS = [  # (path, body, field named in the error or None)
    ("/v1/completions", b'{"prompt": [1, 2', None),  # malformed JSON
    ("/v1/completions", b"[1, 2]", None),  # not an object
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, "seed"),
    ("/v1/completions", {"prompt": list(range(MAX_LEN))}, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": "x" * 200}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens"),  # prompt + max_tokens > context
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [1, 256]}, "prompt"),  # token id out of range
    ("/v1/completions", {"prompt": [-1, 3]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 256]]}, "prompt"),  # a batch of prompts, one out of range
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100}, "n"),  # more sequences than rows + queue
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 needs echo
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
]


def check_bad_inputs(url: str):
    for path, body, field in BAD_INPUTS:
        status, reply, _ = post(url, path, body)
        assert status == 400, (body, status, reply)
        err = reply["error"]
        assert err["type"] == "invalid_request_error" and err["message"], reply
        assert err["param"] == field, (body, reply)
    status, reply, _ = post(url, "/v1/completions", {"model": "other", "prompt": "hi"})
    assert status == 404 and reply["error"]["param"] == "model"
    # still serving
    status, reply, _ = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert status == 200 and reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def check_compiles_fixed(url: str):
    """A round of varied traffic (lengths, sampling, stop strings, streams, chat, a cancel) compiles nothing."""
    before = metric(url, "xla_compiles_total")
    c = client(url)
    ps = prompts(7, 6)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(completion, url, p, 3 + i, i % 2 == 0) for i, p in enumerate(ps)]
        jobs.append(pool.submit(lambda: c.completions.create(model="tiny", prompt="abc", max_tokens=20,
                                                             temperature=0.8, top_p=0.9, seed=5, stop=["e", "zz"])))
        jobs.append(pool.submit(lambda: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0)))
        for j in jobs:
            j.result()
    stream = c.completions.create(model="tiny", prompt="x" * 40, max_tokens=8, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    assert metric(url, "xla_compiles_total") == before
    assert metric(url, "decode_steps_total") > 0


def check_disconnect(url: str, model, engine: Engine):
    """Every row busy with a long stream and one request queued; one stream's client leaves after its
    first token: its row goes to the queued request at once (which finishes while the other streams
    still run), and the other streams are undisturbed (== generate alone)."""
    c = client(url)
    rng = np.random.default_rng(11)
    ps = [rng.integers(0, 256, k).tolist() for k in (2, 3, 4, 1, 3)]
    long = MAX_LEN - 4
    cancelled = metric(url, 'requests_total{outcome="cancelled"}', 0.0)
    leaver = c.completions.create(model="tiny", prompt=ps[0], max_tokens=long, temperature=0, stream=True)
    next(iter(leaver))
    with concurrent.futures.ThreadPoolExecutor(MAX_BATCH) as pool:
        stayers = [pool.submit(completion, url, p, long, True) for p in ps[1:MAX_BATCH]]
        wait_for(lambda: metric(url, "active_slots") == MAX_BATCH)
        waiting = pool.submit(completion, url, ps[MAX_BATCH], 2, False)
        wait_for(lambda: metric(url, "queue_length") == 1)
        leaver.close()  # the client goes away mid-stream
        ids, _, reason = waiting.result()
        still_running = sum(not f.done() for f in stayers)
        results = [f.result() for f in stayers]
    assert still_running == MAX_BATCH - 1, "the queued request waited for another stream to end"
    assert ids == reference(model, ps[MAX_BATCH])[:2] and reason == "length"
    for p, (ids, _, reason) in zip(ps[1:MAX_BATCH], results):
        assert len(ids) == long and ids[:REF_NEW] == reference(model, p) and reason == "length"
    wait_for(lambda: metric(url, 'requests_total{outcome="cancelled"}', 0.0) == cancelled + 1)
    wait_for(lambda: metric(url, "active_slots") == 0)


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def small_model():
    cfg = load_config("tiny", OVERRIDES).model
    return create_model(cfg, seed=1)


# --- tests -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = small_model()
    engine = Engine(model, max_batch=MAX_BATCH, max_len=MAX_LEN, prefill_chunk=CHUNK, max_queue=16)
    profiler = StepProfiler(tmp_path_factory.mktemp("profile"))  # as server.serve sets it up
    engine.step_scope = profiler.step
    with running_server(engine, profiler=profiler) as url:
        yield url, model, engine


def slow_steps(engine: Engine, monkeypatch):
    """20 ms more per decode step (every program)."""
    def slowed(step):
        return lambda *args: (time.sleep(0.02), step(*args))[1]
    monkeypatch.setattr(engine, "decode_programs", {rows: slowed(step) for rows, step in engine.decode_programs.items()})


def test_concurrent_greedy_requests_equal_generate_alone(served):
    url, model, _ = served
    check_concurrent_equals_alone(url, model)


def test_client_disconnect_frees_its_slot(served, monkeypatch):
    url, model, engine = served
    slow_steps(engine, monkeypatch)  # the long streams surely outlast the short request
    check_disconnect(url, model, engine)


def test_bad_input_is_400_naming_the_field(served):
    check_bad_inputs(served[0])


def test_no_compiles_as_requests_come_and_go(served):
    check_compiles_fixed(served[0])


def test_api_surface(served):
    url, _, engine = served
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert json.loads(urllib.request.urlopen(url + "/health").read()) == {"status": "ok"}
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    # streamed chat: role first, then content deltas, finish reason, usage on request
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
    # seeded sampling is reproducible
    a, b = (c.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, top_p=0.9, seed=3)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    for name in ("requests_total", "queue_length", "active_slots", "prompt_tokens_per_second",
                 "generation_tokens_per_second", "time_to_first_token_seconds_count", "xla_compiles_total"):
        assert f"k3jax_{name}" in text


def test_profile_traces_the_next_engine_steps(served):
    """POST /start_profile {"num_steps": N}: a jax.profiler trace of the engine's next N steps, written once
    they have run, naming the engine's programs; one at a time."""
    url, _, _ = served

    def status():
        return json.loads(urllib.request.urlopen(url + "/profile", timeout=30).read())

    assert status()["state"] == "idle"
    code, body, _ = post(url, "/start_profile", {"num_steps": 3})
    assert code == 200 and body["status"] == "scheduled" and body["num_steps"] == 3, body
    assert status()["state"] == "scheduled"  # an idle engine runs no step: the trace waits for a request
    code, body, _ = post(url, "/start_profile", {"num_steps": 3})
    assert code == 409 and "already" in body["error"]["message"]
    assert post(url, "/start_profile", {"num_steps": 0})[0] == 400
    client(url).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=6, temperature=0)
    wait_for(lambda: status()["state"] == "idle")
    traces = status()["traces"]
    assert len(traces) == 1 and traces[0].endswith(".xplane.pb"), traces
    data = pathlib.Path(traces[0]).read_bytes()
    assert b"jit_decode" in data and b"jit_prefill" in data  # the engine's programs, by their jit names


def test_queue_full_is_503_with_retry_after(served, monkeypatch):
    url, _, engine = served
    slow_steps(engine, monkeypatch)
    monkeypatch.setattr(engine, "max_queue", 0)  # no waiting: a request beyond the rows is turned away
    c = client(url)
    streams = [c.completions.create(model="tiny", prompt="ab", max_tokens=40, temperature=0, stream=True)
               for _ in range(MAX_BATCH)]
    status, reply, headers = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    for s in streams:
        s.close()
    assert status == 503 and headers["Retry-After"] == "1" and reply["error"]["type"] == "server_overloaded"
    wait_for(lambda: metric(url, "active_slots") == 0)
    monkeypatch.undo()
    status, _, _ = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200


def test_write_row_and_shift_slots_keep_decoding_exact():
    """A prompt prefilled in row 1 of a two-row prefill batch (beside another prompt), written into row
    1 of a batch at another write position, then the batch's slots moved back, then a step of the
    batch's first two rows alone (first_rows / put_first_rows): decoding continues with the logits of
    one uninterrupted sequence, and the third row is untouched."""
    model = small_model()
    graphdef, state = nnx.split(model)
    tok = jax.random.randint(jax.random.key(0), (1, 9), 0, 256)
    # the weights are an argument, not constants baked into every program
    jitted_step = jax.jit(lambda s, t, c, v: nnx.merge(graphdef, s)(t, cache=c, token_valid=v))
    step = lambda t, c, v: jitted_step(state, t, c, v)  # noqa: E731
    full, _ = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tok)
    other = jax.random.randint(jax.random.key(1), (1, 6), 0, 256)
    one = model.init_cache(2, 12)
    _, one = step(jnp.concatenate([other, tok[:, :6]]), one, jnp.ones((2, 6), bool))
    pool = model.init_cache(3, 20)
    for _ in range(10):  # the batch has advanced 10 slots; row 1 joins there
        _, pool = step(jnp.zeros((3, 1), jnp.int32), pool, jnp.zeros((3, 1), bool))
    pool = jax.jit(write_row)(pool, 1, one, pool.length - one.length, 1)
    assert bool(pool.valid[1, 4:10].all()) and not bool(pool.valid[1, :4].any()) and int(pool.positions[1]) == 6
    logits, pool = step(jnp.broadcast_to(tok[:, 6:7], (3, 1)), pool, jnp.ones((3, 1), bool))
    pool = jax.jit(shift_slots)(pool, -4)  # row 1 now holds slots 0-6, the write position is 7
    assert int(pool.length) == 7 and bool(pool.valid[1, :7].all()) and not bool(pool.valid[1, 7:].any())
    logits2, pool = step(jnp.broadcast_to(tok[:, 7:8], (3, 1)), pool, jnp.ones((3, 1), bool))
    logits3, sub = step(jnp.broadcast_to(tok[:, 8:9], (2, 1)), jax.jit(first_rows, static_argnums=1)(pool, 2),
                        jnp.ones((2, 1), bool))
    after = jax.jit(put_first_rows)(pool, sub)
    assert int(after.length) == 9 and bool(after.valid[1, :9].all()) and int(after.positions[1]) == 9

    def row(cache, r):  # every array's row r (the scanned groups' caches lead with the group axis)
        def rows(layers, axis):
            return [x.take(r, axis=axis) for c in layers for x in c]
        return rows(cache.prefix, 0) + rows(cache.groups, 1) + rows(cache.suffix, 0) + [cache.positions[r],
                                                                                        cache.valid[r]]
    for x, y in zip(row(after, 2), row(pool, 2), strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(logits[1, 0], full[0, 6], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits2[1, 0], full[0, 7], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits3[1, 0], full[0, 8], rtol=1e-4, atol=1e-5)


def test_sample_rows_matches_sample_logits_row_by_row():
    logits = jax.random.normal(jax.random.key(1), (4, 50)) * 3
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8), (1.3, 0.3)]
    temperature = jnp.asarray([t for t, _ in settings])
    top_p = jnp.asarray([p for _, p in settings])
    for draw in range(3):
        ks = jax.random.split(jax.random.key(draw), 4)
        got = np.asarray(sample_rows(logits, ks, temperature, top_p))
        for r, (t, p) in enumerate(settings):
            want = sample_logits(logits[r:r + 1], ks[r], temperature=t, top_p=None if p == 1.0 else p)
            assert got[r] == int(want[0]), (r, draw)


def test_text_stream_stop_strings_and_partial_characters():
    tok = ByteTokenizer()
    ts = TextStream(tok, ["END", "xy"])
    out = "".join(ts.add(t) for t in "héllo EN".encode())
    assert out == "héllo " and not ts.stopped  # "EN" held back: it may start "END"
    out += ts.add(ord("D"))
    assert ts.stopped and out == "héllo "
    ts = TextStream(tok, ["END"])
    out = "".join(ts.add(t) for t in "ab EN".encode()) + ts.finish()
    assert out == "ab EN" and not ts.stopped
    half = "é".encode()[:1]
    ts = TextStream(tok)
    assert ts.add(half[0]) == "" and ts.add("é".encode()[1]) == "é"


@pytest.mark.slow
def test_sharded_server_on_4_fake_devices():
    """The concurrency, bad-input and compile checks against a server whose model is split over 4
    fake CPU devices (``--mesh fsdp=4``; the device count must be set before JAX starts)."""
    run_child("sharded_server", n=4)  # tests/children/sharded_server.py


@pytest.mark.slow
def test_infer_cli_serves(tmp_path):
    """``python infer.py --serve`` on an exported checkpoint answers the openai client."""
    from k3jax.interop import to_hf

    # the loader pairs a HF checkpoint with the default train settings (seq_len 128): the model's own length
    to_hf(create_model(load_config("tiny", ["model.num_layers=5"]).model), tmp_path / "ckpt")
    port = free_port()
    env = subprocess_env()  # XLA's optimisation passes off: the server's programs compile faster
    proc = subprocess.Popen([sys.executable, str(ROOT / "infer.py"), "--serve", "--checkpoint", str(tmp_path / "ckpt"),
                             "--tokenizer", "byte", "--port", str(port), "--max-batch", "2", "--max-len", "32",
                             "--prefill-chunk", "8", "--model-name", "demo"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, timeout_s=600)
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["demo"]
        r = c.completions.create(model="demo", prompt="And God said", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(60)
