"""Attention over a decoding cache split over 8 devices: both layouts (split keys / split queries) equal the
single-device op, with rows and shards that see nothing; the slot write equals ``dynamic_update_slice``
(chunks at, across and over shard boundaries); a 2-layer MLA model decodes (batch 1 and 2, a left-padded row)
and prefills a chunk into a partly filled 4096-slot cache split 8 (or 4) ways with the single-device logits
and cache; and the compiled programs' collectives move the partials or the cache once, where the
GSPMD-partitioned loops move the cache per key block. Run by ``tests/test_cache_attention.py``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from chunked_prefill import prefill_padded_rows
from cpu_devices import rel
from k3jax import create_model, load_config
from k3jax.aot import breakdown as hlo_breakdown
from k3jax.ops.attention import chunked_attention
from k3jax.parallel import cache_attention as ca
from k3jax.sharding import logical_to_spec, make_mesh, parse_mesh, shard_model


def main() -> None:
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)

    # ---- the op: both layouts equal the single-device blockwise attention
    B, S, H, D, DV = 2, 256, 3, 12, 8
    kv = normal(B, S, D)
    parts = lambda kv: (kv[..., :DV], kv[..., DV:])  # noqa: E731 - the stored key parts; the first is the values
    valid = np.arange(S)[None] < np.array([[150], [100]])
    valid[1, :20] = False
    valid = jnp.asarray(valid)
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    for t, start in ((1, 149), (16, 120), (64, 10)):
        q = normal(B, t, H, D)
        q_index = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (B, t))
        row_valid = valid.at[1].set(False) if t == 16 else valid  # a row that sees nothing
        ref = chunked_attention(q, parts(kv), kv[..., :DV], q_index, slots, kv_valid=row_valid, scale=0.3)
        stacked = tuple(jnp.stack([p[::-1], p]) for p in parts(kv))  # layer 1 of a 2-layer stack, read in place
        for mesh_text, shards in (("sequence=8", 8), ("data=2,expert=2,tensor=2", 4)):
            with jax.set_mesh(make_mesh(parse_mesh(mesh_text))):
                assert ca.slot_shards(B, S) == shards
                for split in ("keys", "queries") if t % shards == 0 else ("keys",):
                    attend = lambda q, kv, qi, v, layer: ca.cache_attention(  # noqa: E731
                        q, kv, qi, v, kv_layer=layer, scale=0.3, split=split, q_chunk=8, kv_chunk=16)
                    for kv_parts, layer in ((parts(kv), None), (stacked, 1)):
                        got = jax.jit(attend, static_argnums=4)(q, kv_parts, q_index, row_valid, layer)
                        err = rel(got, ref)
                        assert err < 1e-6, (t, mesh_text, split, layer, err)
    # ---- the write: new entries land where dynamic_update_slice puts them (32 slots a shard: at a shard
    # boundary, straddling two, spanning four, filling the cache)
    for t, start in ((1, 31), (1, 32), (20, 25), (100, 10), (S, 0)):
        new = normal(B, t, D)
        want = jax.lax.dynamic_update_slice_in_dim(kv, new, start, axis=1)
        for mesh_text in ("sequence=8", "data=2,expert=2,tensor=2"):
            with jax.set_mesh(make_mesh(parse_mesh(mesh_text))):
                got = jax.jit(ca.write_slots)(kv, new, start)
                got_stacked = jax.jit(ca.write_slots)(jnp.stack([kv, -kv]), new, start, 0)  # layer 0 of 2
            np.testing.assert_array_equal(got, want, err_msg=f"{t} {start} {mesh_text}")
            np.testing.assert_array_equal(got_stacked, jnp.stack([want, -kv]), err_msg=f"{t} {start} {mesh_text}")
    with jax.set_mesh(make_mesh(parse_mesh("sequence=8"))):
        assert ca.slot_shards(B, 100) == 1  # 100 slots do not split 8 ways: the GSPMD path
        try:
            ca.cache_attention(q[:, :4], parts(kv), q_index[:, :4], valid, scale=0.3, split="queries")
            raise AssertionError("4 queries split over 8 shards")
        except ValueError as e:
            assert "do not split over 8" in str(e), e

    # ---- the compiled programs: the partials or the cache move once, not the cache per key block
    S, H, D, DV, KV_CHUNK = 4096, 4, 40, 32, 256
    mesh = make_mesh(parse_mesh("expert=8"))
    cache_spec = NamedSharding(mesh, logical_to_spec(("batch", "cache_length", None), None, mesh, (1, S, D)))
    valid_spec = NamedSharding(mesh, logical_to_spec(("batch", "cache_length"), None, mesh, (1, S)))

    def per_device(fn, t):  # (matmul FLOPs, collective bytes) of one device, loop trips applied (k3jax.aot.breakdown)
        args = (jax.ShapeDtypeStruct((1, t, H, D), jnp.float32),
                jax.ShapeDtypeStruct((1, S, D), jnp.float32, sharding=cache_spec),
                jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1, S), bool, sharding=valid_spec))
        with jax.set_mesh(mesh):
            counts = hlo_breakdown.breakdown(jax.jit(fn).lower(*args).compile().as_text())
        return counts.total_flops, sum(counts.collective_bytes.values())

    def gspmd(q, kv, q_index, kv_valid):
        slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (1, S))
        return chunked_attention(q, parts(kv), kv[..., :DV], q_index, slots, kv_valid=kv_valid, scale=0.3,
                                 kv_chunk=KV_CHUNK)

    gathered = (S * D * 4 + S) * 7 / 8  # what one device receives of the gathered cache and its valid flags
    moved = {}
    for t, split in ((1, "keys"), (64, "keys"), (512, "queries")):
        fn = lambda q, kv, *a: ca.cache_attention(q, parts(kv), *a, scale=0.3, split=split, kv_chunk=KV_CHUNK)
        (flops, moved[t, split]), (gspmd_flops, moved[t, "gspmd"]) = per_device(fn, t), per_device(gspmd, t)
        # an eighth of the scores and weighted values; split keys moves the float32 partials' all-reduce
        # (output, lse, max: twice 7/8 of them), split queries the cache once
        assert flops <= 1.01 * 2 * t * H * S * (D + DV) / 8, (t, split, flops)
        assert moved[t, split] <= 1.01 * (2 * t * H * (DV + 2) * 4 * 7 / 8 if split == "keys" else gathered), moved
        # GSPMD's partitioned loops: every device repeats all the work, over the gathered cache
        assert gspmd_flops >= 7.9 * flops and moved[t, "gspmd"] > gathered, (t, gspmd_flops, moved)
    moved = {f"{t} {how}": v for (t, how), v in moved.items()}
    # writing a 512-token chunk: the chunk is gathered (7/8 of it), not the cache
    def write_bytes(fn):
        args = (jax.ShapeDtypeStruct((1, S, D), jnp.float32, sharding=cache_spec),
                jax.ShapeDtypeStruct((1, 512, D), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
        with jax.set_mesh(mesh):
            return sum(hlo_breakdown.breakdown(jax.jit(fn).lower(*args).compile().as_text()).collective_bytes.values())

    moved["512 write"] = write_bytes(ca.write_slots)
    moved["512 write gspmd"] = write_bytes(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=1))
    assert moved["512 write"] <= 512 * D * 4 * 7 / 8 and moved["512 write gspmd"] >= S * D * 4 * 7 / 8, moved

    # ---- the model: decode and prefill into a slot-split cache equal the single-device run
    cfg = load_config("tiny", ["model.layout=mla", "model.num_layers=2", "model.first_dense_layers=2",
                               "model.max_seq_len=4096"]).model
    model = create_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, tok, valid, c: nnx.merge(graphdef, s)(tok, cache=c, token_valid=valid))
    # a prompt (keys split: shard 0 alone holds it), a 512-token chunk (queries split), 3 decode steps (keys)
    lengths, expected = (40, 512, 1, 1, 1), {40: "keys", 512: "queries", 1: "keys"}
    chosen = {}  # queries per row -> the layout the rule chose (recorded at trace time)
    rule = ca.choose_split
    ca.choose_split = lambda **kw: chosen.setdefault(kw["queries"], rule(**kw))

    run = functools.partial(prefill_padded_rows, model, step, lengths, 4096, 10)  # run(batch, state, mesh=None)

    worst = 0.0
    for batch, meshes in ((1, ("expert=8",)), (2, ("sequence=8", "fsdp=2,expert=4"))):
        ref_logits, ref_cache = run(batch, state)
        for mesh_text in meshes:
            mesh = make_mesh(parse_mesh(mesh_text))
            sharded = nnx.state(shard_model(create_model(cfg, seed=1), mesh))
            chosen.clear()
            with jax.set_mesh(mesh):
                shards = ca.slot_shards(batch, 4096)
                logits, cache = run(batch, sharded, mesh)
            assert shards == (4 if "fsdp" in mesh_text else 8), (mesh_text, shards)
            assert chosen == expected, chosen
            floats = lambda c: [x for x in jax.tree.leaves(c) if jnp.issubdtype(x.dtype, jnp.floating)]
            np.testing.assert_array_equal(cache.valid, ref_cache.valid)
            assert int(cache.length) == sum(lengths) and np.all(np.asarray(cache.positions == ref_cache.positions))
            err = max(rel(logits, ref_logits), rel(floats(cache), floats(ref_cache)))
            assert err < 1e-5, (batch, mesh_text, err)
            worst = max(worst, err)
    print("OK", {k: f"{v:.3g}" for k, v in moved.items()}, "model err", worst)


if __name__ == "__main__":
    main()
