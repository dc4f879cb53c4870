"""A tiny K3 on one 32,768-token row over 8 sequence shards gives the single-device loss, logits and gradients
(packed documents with boundaries inside shards and on one); no shard holds the row's MLA keys or values (the
jaxpr of every ``shard_map`` body), and the only whole-row collectives are MLA's latent gather and the segment
ids' (the optimized HLO). Run by ``tests/test_long_context.py``; argv: the model's config overrides."""

import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_devices import rel
from jaxprs import shard_map_avals
from k3jax import create_model, load_config
from k3jax.config import MeshConfig
from k3jax.model import abstract_model
from k3jax.sharding import batch_sharding, make_mesh, state_shardings


def main(overrides: list[str]) -> None:
    T, SP = 32768, 8  # 4096 tokens per shard
    cfg = load_config("tiny", overrides).model
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (1, T)), jnp.int32)
    # documents: one crossing shards 0-1, one ending exactly where shard 2 starts (8192), one starting
    # there and crossing two more shards, short ones inside shard 4, one to the end but the padding
    bounds = [0, 5000, 8192, 19000, 19003, 19500, 32000, T]
    seg = np.zeros((1, T), np.int32)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[0, a:b] = i + 1
    seg[0, 32000:] = 0  # padding
    seg = jnp.asarray(seg)
    graphdef, params, rest = nnx.split(create_model(cfg), nnx.Param, ...)

    def loss_fn(graphdef):
        def loss(params, rest, tokens, seg):
            logits, _, _ = nnx.merge(graphdef, params, rest).forward(tokens, segment_ids=seg)
            logp = jax.nn.log_softmax(logits[:, :-1])
            nll = -jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], logits.shape[-1]), axis=-1)
            keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
            return jnp.sum(nll * keep) / jnp.sum(keep), logits
        return jax.value_and_grad(loss, has_aux=True)

    t0 = time.perf_counter()
    ref_compiled = jax.jit(loss_fn(graphdef)).lower(params, rest, tokens, seg).compile()
    tc = time.perf_counter()
    (ref_loss, ref_logits), ref_grads = ref_compiled(params, rest, tokens, seg)
    jax.block_until_ready(ref_grads)
    t1 = time.perf_counter()
    print(f"single device: compile {tc - t0:.1f} s, run {t1 - tc:.1f} s", flush=True)

    mesh = make_mesh(MeshConfig(data=1, sequence=SP))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(params, state_shardings(params, mesh)),
                  jax.device_put(rest, state_shardings(rest, mesh)),
                  jax.device_put(tokens, batch_sharding(mesh)), jax.device_put(seg, batch_sharding(mesh))]
        fn = loss_fn(nnx.split(abstract_model(cfg), nnx.Param, ...)[0])
        jaxpr = jax.make_jaxpr(fn)(*placed).jaxpr
        compiled = jax.jit(fn).lower(*placed).compile()
        tc = time.perf_counter()
        (loss, logits), grads = compiled(*placed)
        jax.block_until_ready(grads)
    t2 = time.perf_counter()
    print(f"8 shards: trace + compile {tc - t1:.1f} s, run {t2 - tc:.1f} s", flush=True)
    errs = (rel(loss, ref_loss), rel(logits, ref_logits), rel(grads, ref_grads))
    assert errs[0] < 1e-5 and errs[1] < 2e-5 and errs[2] < 1e-4, errs

    # 1. inside the shard_map bodies (the per-shard programs), no array as large as the row's expanded keys
    mla = cfg.mla
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    expanded = T * mla.num_heads * min(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
    assert T * latent < expanded

    shapes = {a.shape for a in shard_map_avals(jaxpr)}
    # the heads dim (3) appears in no other array: full-row keys or values, whole or in blocks, would be one
    # with at least T x heads x head_dim elements
    per_head = sorted(s for s in shapes if mla.num_heads in s and np.prod(s) >= expanded)
    assert not per_head, per_head
    assert not [s for s in shapes if T in s and mla.num_heads in s], "a full-row array with a heads dim"
    assert (1, T, latent) in shapes  # the walk does see MLA's gathered latent: the check has teeth

    # 2. the compiled program's collectives: none moves a whole-row array wider than the latent (the residual
    # stream is 32 wide, AttnRes keeps a bank of them, the MoE's tokens; all must stay on their shard)
    hlo = compiled.as_text()
    collectives = re.findall(r"= ([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|all-reduce|all-to-all|"
                             r"collective-permute|reduce-scatter)(?:-start)?\(", hlo)
    whole_row = [(d, s, op) for d, s, op in collectives if s and np.prod([int(x) for x in s.split(",")]) > T * latent]
    assert not whole_row, whole_row
    # whole-row gathers: MLA's latent and the segment ids, nothing else (the router's top-k runs on each
    # device's tokens: k3jax.parallel.sequence.on_own_tokens)
    gathered = {(d, s) for d, s, op in collectives if op == "all-gather" and str(T) in s.split(",")}
    assert ("f32", f"1,{T},{latent}") in gathered and gathered <= {("f32", f"1,{T},{latent}"), ("s32", f"1,{T}")}, \
        gathered
    print(f"OK errors {errs}; single device {t1 - t0:.1f} s, 8 shards {t2 - t1:.1f} s; "
          f"{len(collectives)} collectives, row-length gathers {sorted(gathered)}")


if __name__ == "__main__":
    main(sys.argv[1:])
