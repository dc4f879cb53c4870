"""The whole model on 8 devices: logits, gradients and Quantile Balancing statistics with expert and sequence
parallelism (each alone, and both with data parallelism combined) equal one device's (``forward``), and a
training step with all three matches one device in float32 (``train_step``). Run by ``tests/test_parallel.py``;
argv: the check.

A 4-layer tiny K3 (two scanned [KDA, MLA] groups, every FFN a latent MoE, Block AttnRes) on packed rows whose
documents cross the sequence shards."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_devices import rel
from k3jax import create_model, load_config
from k3jax.ops import quantile_balancing as qb
from k3jax.config import MeshConfig
from k3jax.layers.initializers import RouterBias
from k3jax.model import abstract_model, segment_positions
from k3jax.optim import make_optimizer
from k3jax.sharding import batch_sharding, make_mesh, state_shardings
from k3jax.training.step import TrainState, make_train_step

OVERRIDES = ["model.num_layers=4", "model.mla_period=2", "model.last_layer_mla=false",
             "model.first_dense_layers=0"]
B, T = 8, 64  # T / 8 = 8 tokens per sequence shard (chunk 16 -> one 8-token chunk per shard)


def packed_rows():
    """tokens, segment ids ``[B, T]``: documents start inside shards and at their edges; padding at the end."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (B, T)), jnp.int32)
    seg = np.ones((B, T), np.int32)
    seg[::2, 24:], seg[1::2, 32:], seg[:, 56:] = 2, 3, 0
    return tokens, jnp.asarray(seg)


def new_biases(stats, top_k):
    """The Quantile Balancing bias of each MoE layer's statistics."""
    return {layer: qb.new_bias(st, top_k) for layer, st in stats.items()}


def bias_error_in_bins(stats, ref_stats, top_k):
    """Largest bias difference in histogram bins (bin-edge ties may move one margin by a bin)."""
    got, want = new_biases(stats, top_k), new_biases(ref_stats, top_k)
    return max(float(jnp.max(jnp.abs(got[k] - want[k]) / ((st.high - st.low)[..., None] / st.counts.shape[-1])))
               for k, st in ref_stats.items())


def forward() -> None:
    cfg = load_config("tiny", OVERRIDES)
    tokens, seg = packed_rows()
    graphdef, params, rest = nnx.split(create_model(cfg.model), nnx.Param, ...)

    def loss_fn(graphdef):
        def loss(params, rest, tokens, seg):
            logits, _, stats = nnx.merge(graphdef, params, rest).forward(tokens, segment_ids=seg)
            return jnp.mean(jnp.square(logits)) + jnp.mean(logits[..., 0] * (seg > 0)), (logits, stats.router)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (_, (ref_logits, ref_stats)), ref_grads = loss_fn(graphdef)(params, rest, tokens, seg)
    top_k = cfg.model.moe.top_k
    results = {}
    # Data parallelism alone is the simplest layout (each device a whole model on its rows); it is covered
    # by the combined mesh here and the train step below, so it does not get a compile of its own.
    for axes, dispatch in ((dict(expert=8), "auto"), (dict(sequence=8), "auto"),
                           (dict(data=2, expert=2, sequence=2), "all_to_all")):
        mesh = make_mesh(MeshConfig(**{"data": 1, **axes}))
        variant = abstract_model(load_config("tiny", OVERRIDES + [f"model.moe.ep_dispatch={dispatch}"]).model)
        with jax.set_mesh(mesh):
            placed = [jax.device_put(params, state_shardings(params, mesh)),
                      jax.device_put(rest, state_shardings(rest, mesh)),
                      jax.device_put(tokens, batch_sharding(mesh)), jax.device_put(seg, batch_sharding(mesh))]
            (_, (logits, stats)), grads = loss_fn(nnx.split(variant, nnx.Param, ...)[0])(*placed)
        errs = (rel(logits, ref_logits), rel(grads, ref_grads), bias_error_in_bins(stats, ref_stats, top_k))
        results["+".join(axes)] = errs
        assert errs[0] < 1e-5 and errs[1] < 5e-5 and errs[2] <= 1.0, (axes, errs)
        assert all(jnp.array_equal(stats[k].num_tokens, ref_stats[k].num_tokens) for k in stats)
    print("OK (logits, grads, bias in bins):", results)


def train_step() -> None:
    mesh_axes = ["mesh.data=2", "mesh.expert=2", "mesh.sequence=2"]
    cfg = load_config("tiny", OVERRIDES + mesh_axes + ["train.batch_size=8", "train.seq_len=64", "train.grad_accum=2",
                                                       "train.optim.warmup_steps=0", "train.optim.adam_eps=1e-3"])
    model = create_model(cfg.model)
    tokens, seg = packed_rows()
    with nnx.use_eager_sharding(False):
        ts = TrainState(model, make_optimizer(cfg.train.optim, model, cfg.train.steps))
    graphdef, state = nnx.split(ts)
    targets = jnp.where(seg[:, 1:] == seg[:, :-1], tokens[:, 1:], -1)
    batch = {"tokens": tokens, "segment_ids": seg, "positions": segment_positions(seg),
             "targets": jnp.concatenate([targets, jnp.full((B, 1), -1, jnp.int32)], axis=1), "loss_mask": seg > 0}
    step = make_train_step(graphdef, cfg)
    before = jax.tree.map(jnp.copy, state)
    ref_state, ref_metrics = step(jax.tree.map(jnp.copy, state), batch)

    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        new_state, metrics = step(jax.device_put(state, state_shardings(state, mesh)),
                                  jax.device_put(batch, batch_sharding(mesh)))
    ref_params, got_params, old_params = (nnx.merge(graphdef, s).model for s in (ref_state, new_state, before))
    pick = lambda m: nnx.state(m, nnx.Param)
    # parameters after the update, relative to the size of the update itself (about the learning rate).
    # AdamW's first step is g / (|g| + eps) per element: with the default eps (1e-8), elements whose
    # |g| is near eps (embedding rows and lm_head columns of unseen tokens, zero-initialised AttnRes
    # queries) would turn float32 rounding of the gradient into ~1e-2 of the update. A larger eps keeps
    # the update a well-conditioned function of the gradient, so this compares the gradients the step
    # uses; the loss and the gradient norm are compared tightly.
    leaves = lambda m: [np.asarray(x) for x in jax.tree.leaves(pick(m))]  # compared in numpy: no compiles
    update_err = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b - c)) + 1e-30))
                     for a, b, c in zip(leaves(got_params), leaves(ref_params), leaves(old_params)))
    bias = lambda m: [np.asarray(v[...]) for _, v in nnx.iter_graph(m) if isinstance(v, RouterBias)]
    bias_err = max(float(np.max(np.abs(a - b))) for a, b in zip(bias(got_params), bias(ref_params)))
    loss_err = abs(float(metrics["loss"]) - float(ref_metrics["loss"])) / float(ref_metrics["loss"])
    norm_err = abs(float(metrics["grad_norm"]) - float(ref_metrics["grad_norm"])) / float(ref_metrics["grad_norm"])
    # the histogram's bin width bounds the bias error (a margin on a bin edge may change bins)
    bin_width = 2.0 / cfg.model.moe.qb_bins
    assert bool(metrics["finite"]) and loss_err < 1e-5 and norm_err < 1e-5, (loss_err, norm_err)
    assert update_err < 5e-4 and bias_err <= 2 * bin_width, (update_err, bias_err)
    print("OK loss", loss_err, "grad_norm", norm_err, "update", update_err, "bias", bias_err)


if __name__ == "__main__":
    {"forward": forward, "train_step": train_step}[sys.argv[1]]()
