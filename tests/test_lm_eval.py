"""lm-evaluation-harness (the real package, ``lm_eval.simple_evaluate``) runs the bundled
``kjv_cloze`` task both ways, ``local-completions`` against the server (its remote tokenizer, 4
prompts per request, 2 concurrent requests) and the in-process ``k3jax`` model, and both give the
per-choice log-likelihoods (1e-4 over a continuation's sum), greedy flags and accuracies of direct
scoring: a plain forward + log_softmax of each context + choice. Also the in-process model's
generation (== ``k3jax.generate``, greedy, cut at the stop string) and rolling log-likelihood, the
task's items, and ``python -m k3jax.evaluation``'s arguments."""

from __future__ import annotations

import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import create_model, generate, load_config
from k3jax.tokenizer import ByteTokenizer
from k3jax.serving.engine import Engine
from test_serving import running_server

pytestmark = pytest.mark.usefixtures("fast_xla")

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

from k3jax.evaluation import TASKS_DIR, K3JaxLM  # noqa: E402

# the longest kjv_cloze context + choice is 251 bytes: nothing is truncated
MAX_LEN, CHUNK, BATCH = 256, 64, 4
ROWS = 16  # forward_logprobs' batch: one compiled forward for the 192 scored sequences and the rolling texts
OVERRIDES = ["model.num_layers=5", f"model.max_seq_len={MAX_LEN}", "train.seq_len=32", "model.init_std=0.1"]
TOK = ByteTokenizer()
NEWLINE = TOK.encode("\n")[0]  # the byte tokenizer has no BOS / EOS: rolling windows start from a newline


@pytest.fixture(scope="module")
def model():
    return create_model(load_config("tiny", OVERRIDES).model, seed=1)


@pytest.fixture(scope="module")
def direct(model):
    """``direct_scores`` of the model, each list of docs scored once for the module (the server and
    the in-process runs compare against the same 48 docs)."""
    scored = {}

    def scores(docs: list[dict]) -> list[list[tuple[float, bool]]]:
        key = json.dumps(docs, sort_keys=True)
        if key not in scored:
            scored[key] = direct_scores(model, docs)
        return scored[key]

    return scores


@pytest.fixture(scope="module")
def in_process(model):
    lm = K3JaxLM(model=model, tokenizer=TOK, batch_size=BATCH, max_length=MAX_LEN, prefill_chunk=CHUNK,
                 prefix_token=NEWLINE)
    yield lm
    lm.close()


@functools.partial(jax.jit, static_argnums=0)
def _logprobs(graphdef, state, tokens):
    """log_softmax (float32) of the logits of ``tokens`` ``[ROWS, MAX_LEN]``: the weights are an
    argument, not constants of the program, so every call shares one compile."""
    logits, _ = nnx.merge(graphdef, state)(tokens)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def forward_logprobs(model, sequences: list[list[int]]) -> list[np.ndarray]:
    """log_softmax (float32) of the model's logits over each sequence alone, ``[len, V]`` each."""
    padded = np.zeros((-(-len(sequences) // ROWS) * ROWS, MAX_LEN), np.int32)
    for i, s in enumerate(sequences):
        padded[i, :len(s)] = s
    graphdef, state = nnx.split(model)
    logp = np.concatenate([np.asarray(_logprobs(graphdef, state, jnp.asarray(padded[i:i + ROWS])))
                           for i in range(0, len(padded), ROWS)])
    return [logp[i, :len(s)] for i, s in enumerate(sequences)]


def direct_scores(model, docs: list[dict]) -> list[list[tuple[float, bool]]]:
    """(log-likelihood, greedy) of each doc's choices after its context, as lm-eval asks for them
    (context + " " + choice)."""
    pairs = [(TOK.encode(d["context"]), TOK.encode(" " + c)) for d in docs for c in d["choices"]]
    logps = forward_logprobs(model, [ctx + cont for ctx, cont in pairs])
    out = []
    for (ctx, cont), logp in zip(pairs, logps):
        rows = logp[len(ctx) - 1:len(ctx) - 1 + len(cont)]
        out.append((float(rows[np.arange(len(cont)), cont].sum()), bool((rows.argmax(-1) == cont).all())))
    return [out[i:i + len(d["choices"])] for i, d in zip(range(0, len(out), 4), docs)]


def run_task(lm, model_args=None) -> dict:
    return lm_eval.simple_evaluate(model=lm, model_args=model_args, tasks=["kjv_cloze"], batch_size=BATCH,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR)), log_samples=True,
                                   bootstrap_iters=0)


def check_against_direct(results: dict, scores):
    """``scores``: the ``direct`` fixture."""
    samples = sorted(results["samples"]["kjv_cloze"], key=lambda s: s["doc_id"])
    docs = [s["doc"] for s in samples]
    assert len(docs) == 48
    direct = scores(docs)
    for s, want in zip(samples, direct):
        got = [r[0] for r in s["resps"]]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4, rtol=0)
        assert [bool(g[1]) for g in got] == [w[1] for w in want]
    acc = np.mean([int(np.argmax([w[0] for w in want])) == d["label"] for want, d in zip(direct, docs)])
    norm = np.mean([int(np.argmax([w[0] / len(c) for w, c in zip(want, d["choices"])])) == d["label"]
                    for want, d in zip(direct, docs)])
    scores = results["results"]["kjv_cloze"]
    assert scores["acc,none"] == pytest.approx(acc) and scores["acc_norm,none"] == pytest.approx(norm)


@pytest.mark.slow
def test_local_completions_against_the_server_equals_direct_scoring(model, direct):
    engine = Engine(model, max_batch=BATCH, max_len=MAX_LEN, prefill_chunk=CHUNK, max_queue=16)
    with running_server(engine) as url:
        results = run_task("local-completions", {
            "model": "tiny", "base_url": url + "/v1/completions", "tokenizer_backend": "remote",
            "tokenized_requests": True, "max_length": MAX_LEN, "num_concurrent": 2, "max_retries": 1})
    check_against_direct(results, direct)


@pytest.mark.slow
def test_in_process_model_equals_direct_scoring(in_process, direct):
    check_against_direct(run_task(in_process), direct)


@pytest.mark.slow
def test_in_process_generation_and_rolling_loglikelihood(model, in_process):
    """generate_until == k3jax.generate (greedy) cut before the stop string; loglikelihood_rolling ==
    the forward's sum over the text after the prefix token."""
    contexts = ["And God said", "In the beginning", "x"]
    until = ["e", "zz"]
    got = in_process.generate_until([types.SimpleNamespace(args=(c, {"until": until, "max_gen_toks": 12}))
                                     for c in contexts])
    padded = np.zeros((len(contexts), 16), np.int32)  # one generate program for all
    for i, c in enumerate(contexts):
        padded[i, :len(c)] = TOK.encode(c)
    out = np.asarray(generate(model, padded, 12, prompt_lengths=[len(c) for c in contexts]))
    for i, (context, text) in enumerate(zip(contexts, got)):
        want = TOK.decode(out[i, len(context):len(context) + 12].tolist())
        cut = min([i for i in (want.find(s) for s in until) if i >= 0], default=len(want))
        assert text == want[:cut]
    texts = ["Let there be light.", "And the evening and the morning were the first day."]
    rolling = in_process.loglikelihood_rolling([types.SimpleNamespace(args=(t,)) for t in texts])
    for text, value, logp in zip(texts, rolling, forward_logprobs(model, [[NEWLINE] + TOK.encode(t) for t in texts])):
        ids = TOK.encode(text)
        assert value == pytest.approx(float(logp[np.arange(len(ids)), ids].sum()), abs=1e-4)


def test_kjv_cloze_items():
    """48 items, 4 distinct choices each, the answer's words follow the context in a verse of the corpus."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kjv_cloze", TASKS_DIR / "kjv_cloze.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    text = task.CORPUS.read_text()
    items = task.items(text)
    assert len(items) == task.ITEMS and items == task.items(text)  # deterministic
    verses = {" ".join(v) for v in task.verses(text)}
    assert len({d["label"] for d in items}) > 1
    for d in items:
        assert len(d["choices"]) == 4 == len(set(d["choices"]))
        assert any(v.startswith(d["context"] + " " + d["choices"][d["label"]]) for v in verses)
    with pytest.raises(ValueError, match="kjv_cloze needs"):
        task.items("Genesis 1\nshort verse here\n")


def test_eval_cli_arguments():
    from k3jax.evaluation.cli import with_defaults

    assert with_defaults(["--tasks", "kjv_cloze"], "/t") == ["--tasks", "kjv_cloze", "--model", "k3jax",
                                                             "--include_path", "/t"]
    assert with_defaults(["--model=hf", "--include_path", "/mine"], "/t") == ["--model=hf", "--include_path", "/mine"]
    with pytest.raises(ValueError, match="checkpoint=PATH"):
        K3JaxLM()
