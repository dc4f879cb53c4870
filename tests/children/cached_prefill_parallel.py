"""The 8-device checks of ``tests/test_cached_prefill_parallel.py`` (its docstring lists them): a prefill chunk
whose time axis is split over devices runs KDA through the sequence-parallel fold seeded with the cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from chunked_prefill import prefill_padded_rows
from cpu_devices import rel
from k3jax import cache as cache_lib
from k3jax import create_model, load_config
from k3jax.aot import breakdown as hlo_breakdown
from k3jax.cache import KDACache
from k3jax.layers.kda import KDA
from k3jax.ops.conv import causal_conv1d
from k3jax.ops.kda import chunk_kda
from k3jax.ops.norms import l2_norm
from k3jax.parallel import sequence
from k3jax.sharding import CACHE_AXES, make_mesh, named_sharding, parse_mesh, shard_model


def main() -> None:
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)

    # ---- the ops, seeded with a state: equal the single-device ops (values and gradients)
    B, T, H, K, V, W, CHUNK = 2, 64, 2, 8, 6, 4, 16
    seg = np.ones((B, T), np.int32)
    seg[0, 20:], seg[0, 32:], seg[1, 5:] = 2, 3, 2  # doc 3 starts at a shard boundary (4 shards); row 0's
    seg = jnp.asarray(seg)  # first document continues the state, row 1's is 5 tokens long
    x, w, conv0 = normal(B, T, H * K), normal(W, H * K), normal(B, W - 1, H * K)
    q, k, v = l2_norm(normal(B, T, H, K)), l2_norm(normal(B, T, H, K)), normal(B, T, H, V)
    g = -jax.nn.softplus(3.0 * normal(B, T, H, K))
    beta = jax.nn.sigmoid(normal(B, T, H))
    state0 = normal(B, H, K, V)

    def grad_of(f, argnums):  # every output (o and the final state) enters the loss
        loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(*a)))
        return jax.jit(jax.value_and_grad(loss, argnums=argnums))

    worst = {}
    for segment_ids in (None, seg):
        cases = [
            ("conv", lambda x, w, s: causal_conv1d(x, w, segment_ids=segment_ids, initial_state=s,
                                                   output_final_state=True),
             lambda x, w, s: sequence.causal_conv1d(x, w, segment_ids=segment_ids, initial_state=s,
                                                    output_final_state=True), (x, w, conv0)),
            ("kda", lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK,
                                         segment_ids=segment_ids),
             lambda *a: sequence.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK,
                                           segment_ids=segment_ids), (q, k, v, g, beta, state0))]
        for name, single, parallel, args in cases:
            argnums = tuple(range(len(args)))
            ref_out, ref_grad = jax.jit(single)(*args), grad_of(single, argnums)(*args)
            for mesh_text, shards in (("sequence=8", 8), ("fsdp=2,expert=4", 4)):
                with jax.set_mesh(make_mesh(parse_mesh(mesh_text))):
                    assert sequence.sequence_shards(T, batch=B) == shards
                    out, grad = jax.jit(parallel)(*args), grad_of(parallel, argnums)(*args)
                err = max(rel(out, ref_out), rel(grad, ref_grad))
                assert err < 2e-5, (name, mesh_text, segment_ids is not None, err)
                worst[name] = max(worst.get(name, 0.0), err)
    # without an initial state or a final one: zero state in, nothing out (the training path)
    with jax.set_mesh(make_mesh(parse_mesh("sequence=8"))):
        o, final = jax.jit(lambda *a: sequence.chunk_kda(*a, chunk_size=CHUNK))(q, k, v, g, beta)
        y, conv_final = jax.jit(lambda x, w: sequence.causal_conv1d(x, w))(x, w)
    assert final is None and conv_final is None
    assert rel(o, chunk_kda(q, k, v, g, beta, chunk_size=CHUNK)[0]) < 2e-5
    assert rel(y, causal_conv1d(x, w)[0]) < 2e-5
    try:
        sequence.chunk_kda(q, k, v, g, beta, initial_state=state0[:, :1])
        raise AssertionError("a state of the wrong shape was accepted")
    except ValueError as e:
        assert "initial_state must be" in str(e), e
    try:
        sequence.causal_conv1d(x, w, initial_state=conv0[:, :2])
        raise AssertionError("a conv window of the wrong shape was accepted")
    except ValueError as e:
        assert "initial_state must be" in str(e), e

    # ---- the compiled cached chunk of one KDA layer: collectives of the fold's size, not the chunk's
    cfg = load_config("tiny", ["model.max_seq_len=512"]).model
    kc = cfg.kda
    with nnx.use_eager_sharding(False):
        layer = KDA(cfg, rngs=nnx.Rngs(0))
    layer_def, layer_params = nnx.split(layer)
    mesh = make_mesh(parse_mesh("expert=8"))
    CHUNK_T = 512
    layer_cache = cache_lib.layer_cache(cfg, "kda", 1, CHUNK_T, jnp.float32)
    cache_sh = [named_sharding(mesh, axes, x.shape) for x, axes in zip(layer_cache, CACHE_AXES[KDACache])]

    def moved(patch_shards):
        def call(params, h, cache):
            return nnx.merge(layer_def, params)(h, cache=cache)
        real = sequence.sequence_shards
        if patch_shards:  # the old path: the layer leaves the split chunk to GSPMD
            sequence.sequence_shards = lambda *a, **kw: 1
        try:
            with jax.set_mesh(mesh):
                h = jax.ShapeDtypeStruct((1, CHUNK_T, cfg.hidden_size), jnp.float32,
                                         sharding=jax.NamedSharding(mesh, jax.P(None, "expert", None)))
                cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                     layer_cache, KDACache(*cache_sh))
                text = jax.jit(call).lower(layer_params, h, cache).compile().as_text()
        finally:
            sequence.sequence_shards = real
        return hlo_breakdown.breakdown(text).collective_bytes

    h_, k_, w_ = kc.num_heads, kc.head_dim, kc.conv_size
    state_bytes, conv_bytes = h_ * k_ * k_ * 4, (w_ - 1) * h_ * k_ * 4
    # log2(8) rounds of (map, state) ppermutes, the incoming state, the final state's all-reduce (counted
    # twice); per conv: its halo and its final window's all-reduce
    fold = (3 * 2 + 1 + 2) * state_bytes + 3 * (1 + 2) * conv_bytes
    chunk_bytes = CHUNK_T * h_ * k_ * 4  # one [1, T, H, K] float32 activation
    # the layer's weights are stored split over the mesh (sharding.gather_weight) and all-gathered, as in
    # the model: at most their own bytes, below one chunk activation's; the rest is the fold's
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer_params))
    assert weight_bytes < chunk_bytes
    fold_kinds, gspmd_kinds = moved(False), moved(True)
    gathered = fold_kinds.get("all-gather", 0)
    assert gathered <= weight_bytes, (gathered, weight_bytes)
    fold_moved, gspmd_moved = sum(fold_kinds.values()) - gathered, sum(gspmd_kinds.values())
    assert fold_moved <= 1.1 * fold, (fold_moved, fold)
    assert gspmd_moved >= chunk_bytes, (gspmd_moved, chunk_bytes)

    # ---- the model: chunked prefill of ragged prompts, then decode, equals the single-device run
    cfg = load_config("tiny", ["model.num_layers=4", "model.first_dense_layers=4", "model.max_seq_len=256"]).model
    model = create_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, tok, valid, c: nnx.merge(graphdef, s)(tok, cache=c, token_valid=valid))
    # chunks of 40 (5 tokens a shard of 8), 64, 24 (3 a shard: the conv's halo), 20 (does not split 8 ways:
    # the single-device path), then 3 decode steps
    lengths = (40, 64, 24, 20, 1, 1, 1)
    seeded = []  # (chunk length, initial state given) of the KDA fold's calls, recorded at trace time
    real_kda = sequence.chunk_kda

    def recording_kda(q, *a, **kw):
        seeded.append((q.shape[1], kw.get("initial_state") is not None))
        return real_kda(q, *a, **kw)

    sequence.chunk_kda = recording_kda

    run = functools.partial(prefill_padded_rows, model, step, lengths, 256, 50)  # run(batch, state, mesh=None)

    model_err = 0.0
    for batch, meshes in ((1, ("expert=8",)), (2, ("sequence=8", "fsdp=2,expert=4"))):
        ref_logits, ref_cache = run(batch, state)
        for mesh_text in meshes:
            mesh = make_mesh(parse_mesh(mesh_text))
            sharded = nnx.state(shard_model(create_model(cfg, seed=1), mesh))
            seeded.clear()
            with jax.set_mesh(mesh):
                logits, cache = run(batch, sharded, mesh)
            split = {40, 64, 24} if "fsdp" not in mesh_text else {40, 64, 24, 20}  # 20 splits 4 ways
            assert {t for t, _ in seeded} == split and all(s for _, s in seeded), (mesh_text, seeded)
            floats = lambda c: [x for x in jax.tree.leaves(c) if jnp.issubdtype(x.dtype, jnp.floating)]
            np.testing.assert_array_equal(cache.valid, ref_cache.valid)
            assert np.all(np.asarray(cache.positions == ref_cache.positions))
            err = max(rel(logits, ref_logits), rel(floats(cache), floats(ref_cache)))
            assert err < 2e-5, (batch, mesh_text, err)
            model_err = max(model_err, err)
    print("OK ops", worst, "model", model_err, "bytes fold", fold_moved, "gspmd", gspmd_moved)


if __name__ == "__main__":
    main()
