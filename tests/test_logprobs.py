"""Log-probabilities from the server (k3jax/serving), through the ``openai`` client: the echoed
prompt's and the generated tokens' log-probabilities and top alternatives equal a direct
``log_softmax`` of the model's forward on the same tokens (float32, 1e-5), for concurrent requests
(more than the pool has rows) whose prompts span several prefill chunks, streamed or not, greedy or
sampled; scoring requests (``echo`` + ``max_tokens: 0``), lists of prompts with ``n > 1``, chat
``logprobs`` / ``top_logprobs``, and the vLLM tokenizer endpoints lm-eval uses. None of it compiles
anything once the server is up."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.tokenizer import ByteTokenizer
from k3jax.serving.engine import Engine
from k3jax.serving.logprob_fields import token_bytes, token_text
from k3jax.serving.logprobs import MAX_LOGPROBS, token_logprobs
from test_serving import CHUNK, MAX_BATCH, MAX_LEN, client, metric, post, running_server, small_model

pytestmark = pytest.mark.usefixtures("fast_xla")

TOL = 1e-5
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def served():
    model = small_model()
    engine = Engine(model, max_batch=MAX_BATCH, max_len=MAX_LEN, prefill_chunk=CHUNK, max_queue=16)
    with running_server(engine) as url:
        yield url, model


def forward_logprobs(model, sequences: list[list[int]]) -> list[np.ndarray]:
    """log_softmax of the model's logits (float32) over each sequence alone: ``[len, V]`` each (one
    program: the sequences right-padded to MAX_LEN, which a causal model's earlier positions ignore)."""
    padded = np.zeros((len(sequences), MAX_LEN), np.int32)
    for i, s in enumerate(sequences):
        padded[i, :len(s)] = s
    logits, _ = jax.jit(lambda t: model(t))(jnp.asarray(padded))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return [logp[i, :len(s)] for i, s in enumerate(sequences)]


def text_of(token: int) -> str:
    return token_text(token_bytes(TOK, token))


def check_entry(logp_row: np.ndarray, token: int, logprob: float, top: dict, k: int):
    """One token's fields against the distribution ``logp_row`` [V] it was drawn from."""
    np.testing.assert_allclose(logprob, logp_row[token], atol=TOL, rtol=0)
    best = np.argsort(-logp_row)[:k]
    want = {text_of(int(t)): float(logp_row[t]) for t in best}
    want.setdefault(text_of(token), float(logp_row[token]))
    assert top.keys() == want.keys()
    np.testing.assert_allclose([top[key] for key in want], list(want.values()), atol=TOL, rtol=0)


def completion(url: str, prompt: list[int], max_tokens: int, k: int, echo: bool, stream: bool, temperature: float):
    """(generated ids, logprobs fields merged over the chunks, text) of one completion."""
    c = client(url)
    kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, logprobs=k, echo=echo, temperature=temperature,
              seed=7, extra_body={"return_token_ids": True})
    if not stream:
        choice = c.completions.create(**kw).choices[0]
        lp = choice.logprobs
        return choice.token_ids, (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset), choice.text
    fields, ids, text = ([], [], [], []), [], ""
    for chunk in c.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            lp = choice.logprobs
            for acc, part in zip(fields, (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)):
                acc.extend(part)
    ids = [token_id(t) for t in fields[0][len(prompt) if echo else 0:]]
    return ids, fields, text


def token_id(text: str) -> int:
    """The byte tokenizer's id of a token shown as ``text`` (one byte)."""
    if text.startswith("bytes:"):
        return int(text[len("bytes:\\x"):], 16)
    return text.encode()[0]


def test_echo_and_generated_logprobs_equal_log_softmax_of_forward(served):
    """10 concurrent requests (4 rows), prompts of 1-40 tokens (up to 5 prefill chunks), with and
    without echo, k in 0..20, streamed or not, greedy or sampled: every log-probability and top-k
    equals the forward's; no compile meanwhile."""
    url, model = served
    rng = np.random.default_rng(0)
    lengths = [40, 1, 9, 17, 33, 8, 25, 3, 16, 39]
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    ks = [5, 0, 1, MAX_LOGPROBS, 3, 2, 5, 1, 0, 4]
    before = metric(url, "xla_compiles_total")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        jobs = [pool.submit(completion, url, p, 2 + i % 5, k, i % 3 != 1, i % 2 == 1, 0.0 if i % 4 else 1.0)
                for i, (p, k) in enumerate(zip(prompts, ks))]
        results = [j.result() for j in jobs]
    assert metric(url, "xla_compiles_total") == before
    refs = forward_logprobs(model, [p + ids for p, (ids, _, _) in zip(prompts, results)])
    for i, (prompt, k, (ids, (tokens, lps, tops, offsets), text), ref) in enumerate(zip(prompts, ks, results, refs)):
        echo = i % 3 != 1
        assert len(ids) == 2 + i % 5
        full = prompt + ids if echo else ids
        assert tokens == [text_of(t) for t in full]
        start = len(prompt) - 1 if not echo else 0  # the position whose distribution gave full[0]
        if echo:
            assert lps[0] is None and tops[0] is None
            assert text.startswith(TOK.decode(prompt))
        for j in range(1 if echo else 0, len(full)):
            check_entry(ref[start + j - 1] if echo else ref[start + j], full[j], lps[j], tops[j], k)
        assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))


def test_scoring_requests_lists_of_prompts_and_n(served):
    """``echo`` + ``max_tokens: 0`` scores the prompts only (one of them the whole context); 3 prompts
    x n=2 -> 6 choices, choice i*2+j of prompt i; text offsets of ASCII text are the characters'."""
    url, model = served
    rng = np.random.default_rng(1)
    prompts = [list(b"And God said, Let there be light"), rng.integers(0, 256, MAX_LEN).tolist(), [5, 6]]
    r = client(url).completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0
    refs = forward_logprobs(model, prompts)
    for c in r.choices:
        prompt, ref = prompts[c.index // 2], refs[c.index // 2]
        assert c.finish_reason == "length" and c.text == TOK.decode(prompt)
        assert len(c.logprobs.token_logprobs) == len(prompt) and c.logprobs.token_logprobs[0] is None
        for t in range(1, len(prompt)):
            check_entry(ref[t - 1], prompt[t], c.logprobs.token_logprobs[t], c.logprobs.top_logprobs[t], 2)
    assert r.choices[0].logprobs.text_offset == list(range(len(prompts[0])))
    # a lone request (the batch-1 prefill program) scores the same
    one = client(url).completions.create(model="tiny", prompt=prompts[2], max_tokens=0, echo=True, logprobs=0)
    np.testing.assert_allclose(one.choices[0].logprobs.token_logprobs[1:], r.choices[4].logprobs.token_logprobs[1:],
                               atol=TOL, rtol=0)


def test_chat_logprobs(served):
    url, model = served
    c = client(url)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Let there be"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    prompt, ids = choice.prompt_token_ids, choice.token_ids
    ref = forward_logprobs(model, [prompt + ids])[0]
    content = choice.logprobs.content
    assert [e.token for e in content] == [text_of(t) for t in ids] and len(ids) == 4
    for j, (e, token) in enumerate(zip(content, ids)):
        row = ref[len(prompt) - 1 + j]
        assert e.bytes == list(token_bytes(TOK, token))
        np.testing.assert_allclose(e.logprob, row[token], atol=TOL, rtol=0)
        best = np.argsort(-row)[:3]
        assert [t.token for t in e.top_logprobs] == [text_of(int(t)) for t in best]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], row[best], atol=TOL, rtol=0)
    streamed = [e for chunk in c.chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # (another row: the same to rounding)
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=TOL, rtol=0)
    plain = c.chat.completions.create(model="tiny", messages=kw["messages"], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_tokenizer_endpoints(served):
    url, _ = served
    status, body, _ = post(url, "/tokenize", {"prompt": "Héllo"})
    assert status == 200 and body["tokens"] == list("Héllo".encode()) and body["count"] == 6
    status, body, _ = post(url, "/detokenize", {"tokens": list("Héllo".encode())})
    assert status == 200 and body["prompt"] == "Héllo"
    info = json.loads(urllib.request.urlopen(url + "/tokenizer_info").read())
    assert "eos_token" in info and info["max_model_len"] == MAX_LEN
    for path, body, field in [("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [1, 999]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens")]:
        status, reply, _ = post(url, path, body)
        assert status == 400 and reply["error"]["param"] == field, (path, body, reply)


def test_token_logprobs_op():
    """The device op against NumPy, and its skipped branch."""
    logits = jax.random.normal(jax.random.key(0), (3, 5, 50)) * 4
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 50)
    own, top, ids = token_logprobs(logits, targets, 7, jnp.bool_(True))
    x = np.asarray(logits, np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(own, np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-logp, -1)[..., :7])
    np.testing.assert_allclose(top, np.sort(logp, -1)[..., ::-1][..., :7], atol=1e-5)
    skipped = token_logprobs(logits, targets, 7, jnp.bool_(False))
    assert [a.shape for a in skipped] == [(3, 5), (3, 5, 7), (3, 5, 7)] and not any(np.any(a) for a in skipped)


@pytest.mark.parametrize("vocab,chunk", [(256, 64), (250, 64), (1000, 96)])
def test_chunked_log_softmax_equals_the_whole_row(vocab, chunk):
    """The echo path's log-softmax read ``chunk`` vocabulary columns at a time (a last pass overlapping the
    previous one, a tie at the top) gives the whole row's values and the same top ids."""
    rng = np.random.default_rng(vocab)
    logits = jnp.asarray(rng.normal(size=(3, 5, vocab)) * 4, jnp.float32)
    logits = logits.at[0, 0, 10].set(logits[0, 0, 11] + 50.0).at[0, 0, 11].set(logits[0, 0, 11] + 50.0)
    targets = jnp.asarray(rng.integers(0, vocab, (3, 5)))
    whole = token_logprobs(logits, targets, MAX_LOGPROBS, jnp.bool_(True), vocab_chunk=vocab)
    chunked = token_logprobs(logits, targets, MAX_LOGPROBS, jnp.bool_(True), vocab_chunk=chunk)
    np.testing.assert_allclose(chunked[0], whole[0], atol=5e-6)
    np.testing.assert_allclose(chunked[1], whole[1], atol=5e-6)
    np.testing.assert_array_equal(chunked[2], whole[2])
    assert int(chunked[2][0, 0, 0]) == 10 and int(chunked[2][0, 0, 1]) == 11


def test_chunked_log_softmax_holds_a_chunk_not_the_row():
    logits = jax.ShapeDtypeStruct((2, 64, 32768), jnp.float32)  # 16 MiB: an echo piece's logits
    targets = jax.ShapeDtypeStruct((2, 64), jnp.int32)

    def temps(chunk):
        fn = jax.jit(lambda lg, t: token_logprobs(lg, t, MAX_LOGPROBS, jnp.bool_(True), vocab_chunk=chunk))
        return fn.lower(logits, targets).compile().memory_analysis().temp_size_in_bytes

    assert temps(2048) < 0.5 * 2 * 64 * 32768 * 4 <= temps(32768)
