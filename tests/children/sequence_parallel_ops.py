"""Sequence parallelism on 8 devices: the short conv, chunkwise KDA and the MLA layer with the time axis split
over ``sequence`` (and the data-like axes the batch leaves free) equal their single-device results, forward
and backward, with packed documents that start inside shards and at shard boundaries. Run by
``tests/test_sequence_parallel.py``."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

from cpu_devices import rel
from k3jax import load_config
from k3jax.layers.mla import MLA
from k3jax.ops.conv import causal_conv1d
from k3jax.ops.kda import chunk_kda
from k3jax.ops.norms import l2_norm
from k3jax.parallel import sequence


def main() -> None:
    rng = np.random.default_rng(0)
    B, T, H, K, V, W, CHUNK = 2, 64, 2, 8, 8, 4, 16
    seg = np.ones((B, T), np.int32)
    seg[0, 20:], seg[0, 32:], seg[0, 40:50], seg[0, 50:] = 2, 3, 4, 0  # doc 3 starts at a shard boundary
    seg[1, 7:], seg[1, 9:] = 2, 3  # a 2-token document inside the first shard
    seg = jnp.asarray(seg)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    x, w = normal(B, T, H * K), normal(W, H * K)
    q, k, v = l2_norm(normal(B, T, H, K)), l2_norm(normal(B, T, H, K)), normal(B, T, H, V)
    g = -jax.nn.softplus(3.0 * normal(B, T, H, K))  # log-decays from ~0 to ~-10 (softplus-gate range)
    beta = jax.nn.sigmoid(normal(B, T, H))
    cfg = load_config("tiny").model
    with nnx.use_eager_sharding(False):  # params carry logical axis names, not mesh axes
        mla = MLA(cfg, rngs=nnx.Rngs(0))
    mla_def, mla_params = nnx.split(mla)
    h = normal(B, T, cfg.hidden_size)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def grad_of(f, argnums):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=argnums))

    def cases(segment_ids):
        conv = lambda x, w: causal_conv1d(x, w, segment_ids=segment_ids)[0]
        kda = lambda *a: chunk_kda(*a, chunk_size=CHUNK, segment_ids=segment_ids)[0]
        sp_conv = lambda x, w: sequence.causal_conv1d(x, w, segment_ids=segment_ids)[0]
        sp_kda = lambda *a: sequence.chunk_kda(*a, chunk_size=CHUNK, segment_ids=segment_ids)[0]
        layer = lambda p, h: nnx.merge(mla_def, p)(h, positions=positions, segment_ids=segment_ids)[0]
        return [("conv", conv, sp_conv, (x, w)), ("kda", kda, sp_kda, (q, k, v, g, beta)),
                ("mla", layer, layer, (mla_params, h))]

    # (shape, axis names, time shards): the last splits the time axis over (expert, sequence), the axes the
    # batch of 2 leaves free (fsdp takes the batch)
    meshes = [((8,), ("sequence",), 8), ((2, 2, 2), ("data", "sequence", "tensor"), 2),
              ((2, 2, 2), ("fsdp", "expert", "sequence"), 4)]
    worst = {}
    for segment_ids in (None, seg):
        for name, single, parallel, args in cases(segment_ids):
            argnums = tuple(range(len(args)))
            ref = grad_of(single, argnums)(*args)
            for shape, names, shards in meshes:
                mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
                with jax.set_mesh(mesh):
                    assert sequence.sequence_shards(T, batch=B) == shards
                    got = grad_of(parallel, argnums)(*args)
                err = rel(got, ref)
                assert err < 2e-5, (name, names, segment_ids is not None, err)
                worst[name] = max(worst.get(name, 0.0), err)

    # shards that do not divide T (or are shorter than the conv halo) fall back to the GSPMD path
    with jax.set_mesh(jax.make_mesh((8,), ("sequence",), axis_types=(AxisType.Auto,))):
        assert sequence.sequence_shards(60, batch=B) == 1 and sequence.sequence_shards(16, 3, batch=B) == 1
    # the time axis also takes the data-like axes the batch leaves free, in mesh order
    with jax.set_mesh(jax.make_mesh((2, 2, 2), ("data", "expert", "sequence"), axis_types=(AxisType.Auto,) * 3)):
        assert sequence.time_axes(2, T) == ("expert", "sequence") and sequence.sequence_shards(T, batch=2) == 4
        assert sequence.time_axes(1, T) == ("data", "expert", "sequence") and sequence.sequence_shards(T, batch=1) == 8
        assert sequence.time_axes(4, 6) == ("sequence",) and sequence.time_axes(4, 5) == ()
    print("OK", worst)


if __name__ == "__main__":
    main()
