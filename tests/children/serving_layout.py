"""The serving layout (``k3jax.sharding.SERVING_DECODE`` / ``SERVING_PREFILL``) on 8 devices: the engine's
greedy tokens (prefill, decode, prefix-cache hits) equal the single-device engine's for K3-, K2- and
Kimi-Linear-like tiny models and MXFP4 experts; checkpoints load straight into the layout; and a compiled
decode step in the serving layout moves activations only (its collective bytes within :func:`activation_bytes`), where training's layout gathers
weights past that bound. Run by ``tests/test_serving_layout.py``; argv: ``engine NAME``, ``loading``,
``collectives`` or ``rollout`` (an RL rollout in the serving layout samples what it samples in training's)."""

import sys

import jax

from k3jax import create_model, load_config
from k3jax.aot import Job, compile_job
from k3jax.serving.engine import Engine
from k3jax.serving.request import SamplingParams, Sequence
from k3jax.sharding import make_mesh, parse_mesh, use_mesh
from test_decode import K2_LIKE, KIMI_LINEAR_LIKE

# Every split dimension divides 8: heads, experts, FFN, latent and vocabulary widths.
WIDE = ["model.kda.num_heads=8", "model.mla.num_heads=8", "model.moe.num_experts=16", "model.num_layers=5",
        "model.max_seq_len=64", "train.seq_len=64"]
MODELS = {"k3": [], "k3_mxfp4": ["quant.experts=mxfp4"], "k2_like": K2_LIKE, "kimi_linear_like": KIMI_LINEAR_LIKE}
MESH = "data=2,expert=4"  # the pool's 4 rows split over `data`, their slots over `expert` (flash-decoding)
MAX_LEN, CHUNK, BLOCK, NEW = 48, 4, 8, 6
BASE = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 2, 3]  # 13 tokens: a block and a half


def greedy(engine: Engine, prompts) -> list[list[int]]:
    seqs = [Sequence(p, SamplingParams(max_tokens=NEW), lambda *_: None, lambda _: None) for p in prompts]
    engine.run(seqs)
    return [s.generated for s in seqs]


def engine_outputs(model, mesh) -> list[list[list[int]]]:
    """Greedy tokens of three rounds: distinct prompts; prompts sharing BASE (the second round's hit the
    blocks the first wrote); the same again batched (hits of different lengths in one prefill)."""
    engine = Engine(model, max_batch=4, max_len=MAX_LEN, prefill_chunk=CHUNK, prefill_batch=2, mesh=mesh,
                    unroll_layers=False, prefix_cache_tokens=16 * BLOCK, prefix_cache_block=BLOCK)
    rounds = [[[5, 1, 2], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9], BASE], [BASE + [1, 2], BASE[:9] + [7]],
              [BASE + [3], BASE[:8], [4] + BASE]]
    with use_mesh(mesh) if mesh is not None else jax.default_device(jax.devices()[0]):
        out = [greedy(engine, prompts) for prompts in rounds]
    assert engine.metrics.prefix_hit_tokens >= 2 * BLOCK, engine.metrics.prefix_hit_tokens  # hits happened
    return out


def engine_check(name: str) -> None:
    cfg = load_config("tiny", WIDE + MODELS[name]).model
    model = create_model(cfg, seed=1)
    want = engine_outputs(model, None)
    got = engine_outputs(model, make_mesh(parse_mesh(MESH)))
    assert got == want, (name, got, want)
    print(name, got)


def loading_check() -> None:
    """A train.py checkpoint and a Hugging Face directory load straight into the serving layout (each leaf
    placed by the serving rules as it is read: the engine then finds nothing to move), the routed experts
    over the 8 devices, the head projections split by head, nothing stored as training's FSDP split."""
    import tempfile

    from flax import nnx

    from k3jax.config import Config
    from k3jax.interop import to_hf
    from k3jax.serving.loading import load_model
    from k3jax.sharding import SERVING_DECODE, place_state
    from k3jax.training import checkpoint

    cfg = load_config("tiny", WIDE)
    model = create_model(cfg.model, seed=1)
    mesh = make_mesh(parse_mesh("expert=8"))
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save_model(f"{tmp}/ckpt", model, Config.of_model(cfg.model, "tiny"))
        to_hf(model, f"{tmp}/hf", model_type="kimi_k3")
        for path in (f"{tmp}/ckpt", f"{tmp}/hf"):
            with SERVING_DECODE.active():
                loaded, _ = load_model(path, mesh=mesh)
                _, moved = place_state(nnx.state(loaded), mesh)
            assert not moved, path
            specs = {jax.tree_util.keystr(k): tuple(v.sharding.spec)
                     for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(loaded))}
            q_b = [s for k, s in specs.items() if "q_b" in k]  # [q_lora, heads, head_dim]: split by head
            assert q_b and all(s[-2] == "expert" for s in q_b), q_b
            print(path.rsplit("/", 1)[1], "loaded in the serving layout")


def rollout_check() -> None:
    """An RL rollout (``k3jax.rl.rollout.sample``: a recording engine fed the trainer's arrays, FSDP-split by the
    training rules) in the serving layout (``train.rl.rollout_layout``: the weights moved once) samples what it
    samples in the trainer's own layout: the same tokens and routes, log-probabilities to rounding; released
    weights are dropped and the next set_weights moves them again."""
    import numpy as np
    from flax import nnx

    from k3jax.rl.rollout import sample
    from k3jax.sharding import place_state

    cfg = load_config("tiny", WIDE)
    mesh = make_mesh(parse_mesh("data=2,fsdp=4"))
    with use_mesh(mesh):
        trainer_state, _ = place_state(nnx.state(create_model(cfg.model, seed=1)), mesh)  # the training rules
        graphdef = nnx.graphdef(create_model(cfg.model, seed=1))
        out = {}
        for layout in ("training", "serving"):
            engine = Engine(nnx.merge(graphdef, trainer_state), max_batch=8, max_len=MAX_LEN, prefill_chunk=CHUNK,
                            prefill_batch=8, mesh=mesh, unroll_layers=False, record_routes=True, layout=layout)
            engine.release_weights()
            engine.set_weights(trainer_state)
            same = [a is b for a, b in zip(jax.tree.leaves(engine._state), jax.tree.leaves(trainer_state))]
            assert all(same) if layout == "training" else not all(same), layout  # serving: the split ones moved
            out[layout] = sample(engine, [BASE, [5, 1, 2], BASE[:9] + [7], [4] + BASE], 2, max_new_tokens=NEW,
                                 temperature=0.0, top_p=1.0, stop_ids=(), seeds=list(range(8)))
            engine.release_weights()
            assert engine._state is None
    for a, b in zip(out["training"], out["serving"]):
        assert a.tokens == b.tokens, (a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    print("rollout", [c.tokens for c in out["serving"]])


def activation_bytes(cfg, batch: int) -> int:
    """What a decode step of ``batch`` tokens may move in the serving layout, per device: per layer, for each
    token, 8 residual-width vectors (the all-reduced outputs of row-parallel projections, the embedding),
    its k routed copies there and back in the latent width, its router scores, and its MLA queries in the
    latent space; float32, an all-reduce counted twice (as ``k3jax.aot.breakdown`` counts it). A step that
    moves a weight of every layer exceeds it."""
    m = cfg.model
    latent = m.moe.latent_dim or m.hidden_size
    per_token = (8 * m.hidden_size + 2 * m.moe.top_k * latent + m.moe.num_experts
                 + m.mla.num_heads * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim))
    return m.num_layers * batch * per_token * 4 * 2


def collectives_check() -> None:
    batch = 8
    for name in ("k3", "k2_like"):
        moved = {}
        for layout in ("serving", "training"):
            job = Job("tiny", "decode", "v5p-16", parse_mesh("expert=8"), batch=batch, seq_len=64,
                      overrides=tuple(WIDE + MODELS[name]), layout=layout)
            r = compile_job(job, breakdown=True, devices=jax.devices(), log=lambda s: None)
            moved[layout] = sum(r.breakdown.collective_bytes.values())
        bound = activation_bytes(job.load(), batch)
        print(name, {k: int(v) for k, v in moved.items()}, "bound", bound)
        assert moved["serving"] <= bound < moved["training"], (name, moved, bound)


if __name__ == "__main__":
    jax.config.update("jax_disable_most_optimizations", True)
    assert jax.device_count() == 8
    {"engine": lambda: engine_check(sys.argv[2]), "collectives": collectives_check,
     "loading": loading_check, "rollout": rollout_check}[sys.argv[1]]()
    print("OK")
