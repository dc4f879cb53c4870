"""The training step: loss, gradient accumulation, optimizer update, Quantile Balancing, NaN guard.

One ``jax.jit``-ed function over the split NNX state (``graphdef`` static, state donated). It calls
the same ``model.forward`` that prefill and decoding use.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.ops import quantile_balancing as qb
from k3jax.config import Config, ModelConfig
from k3jax.data.images import vision_batch
from k3jax.layers.lora import LoRAParam
from k3jax.model import ForwardStats, K3Model, abstract_model, create_model
from k3jax.optim import cast_muon_group, make_lora_optimizer, make_optimizer
from k3jax.optim.qk_clip import qk_clip
from k3jax.sharding import state_shardings


# The random stream of the LoRA adapters' initialisation (folded into train.seed): apart from the model's,
# so a LoRA run's base is the same with or without adapters.
LORA_INIT_STREAM = 1
# ... and of their input dropout (folded with the optimizer step and the micro-batch).
LORA_DROPOUT_STREAM = 2


class TrainState(nnx.Module):
    """The model, its optimizer state and the step counter. ``wrt``: the variables that train
    (``nnx.Param``; only the adapters, ``LoRAParam``, in a LoRA run)."""

    def __init__(self, model: K3Model, tx: optax.GradientTransformation, wrt=nnx.Param):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=wrt)
        self.skipped = nnx.Variable(jnp.zeros((), jnp.int32))  # updates skipped by the NaN guard


def trainable(cfg: Config):
    """The variable type a run differentiates and optimizes: ``LoRAParam`` in a LoRA run, else ``nnx.Param``."""
    return LoRAParam if cfg.train.lora.enabled else nnx.Param


def new_train_state(cfg: Config, model: K3Model) -> TrainState:
    """The ``TrainState`` of ``model`` (with its adapters in a LoRA run) and a fresh optimizer state."""
    tc = cfg.train
    tx = (make_lora_optimizer(tc.optim, tc.steps) if tc.lora.enabled
          else make_optimizer(tc.optim, model, tc.steps, seed=tc.seed))
    return TrainState(model, tx, wrt=trainable(cfg))


def abstract_train_state(cfg: Config, model: K3Model | None = None):
    """``(graphdef, state)`` of a ``TrainState`` whose leaves are ShapeDtypeStructs (with the
    Variables' logical axis metadata): the model from ``abstract_model`` (with the adapters of a LoRA run)
    and the optimizer state from ``jax.eval_shape`` of the optimizer's init. Nothing is allocated."""
    model = abstract_model(cfg.model, lora=cfg.train.lora) if model is None else model
    model_def, model_state = nnx.split(model)
    out = {}

    def build(state):
        m = nnx.merge(model_def, state)
        with nnx.use_eager_sharding(False):  # shardings come from the rules, not from eager placement
            ts = new_train_state(cfg, m)
        out["graphdef"], ts_state = nnx.split(ts)
        return ts_state

    state = jax.eval_shape(build, model_state)
    return out["graphdef"], state


def init_train_state(cfg: Config, mesh: jax.sharding.Mesh | None = None) -> TrainState:
    """A freshly initialised ``TrainState`` (weights from ``train.seed``), built by one jitted init
    whose outputs land straight in their rule-derived shardings on ``mesh`` (on the first device
    without one), so no device ever holds more than its shards (full K3 on a pod).

    The weights are the same on every mesh: ``jax.random`` under jit draws them, and with
    partitionable threefry (``jax_threefry_partitionable``, on by default since JAX 0.5) a sharded
    draw gives the values of the unsharded one. A 1-device debugging run and its 8-device scale-out
    start from one model. (``create_model`` outside a jit draws on the host with NumPy: other numbers.)
    The init program compiles once per config; the persistent compilation cache keeps it.
    """

    def build():
        model = create_model(cfg.model, seed=cfg.train.seed)
        if cfg.train.lora.enabled:
            key = jax.random.fold_in(jax.random.key(cfg.train.seed), LORA_INIT_STREAM)
            model.add_lora(cfg.train.lora, nnx.Rngs(params=key))
        with nnx.use_eager_sharding(False):
            return new_train_state(cfg, model)

    graphdef, abstract = abstract_train_state(cfg)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract)
    else:
        shardings = state_shardings(abstract, mesh)
    init = jax.jit(lambda: nnx.state(build()), out_shardings=shardings)
    return nnx.merge(graphdef, init())


def next_token_loss(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, z_loss: float = 0.0):
    """Summed cross entropy (+ z-loss) and the number of counted tokens.

    logits ``[B, T, V]`` float32, targets ``[B, T]`` int (negative = none), loss_mask ``[B, T]``.
    """
    mask = loss_mask.astype(jnp.float32) * (targets >= 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    nll = lse - target_logit
    total = jnp.sum(nll * mask)
    if z_loss:
        total = total + z_loss * jnp.sum(jnp.square(lse) * mask)
    return total, jnp.sum(mask), jnp.sum(nll * mask)


def _micro_batches(batch: dict, n: int) -> dict:
    """``[B, ...]`` -> ``[n, B / n, ...]``, micro-batch i = rows i, i + n, ... (strided, not blocks):
    each device's contiguous block of the batch-sharded rows then feeds every micro-batch, so the
    micro-batches stay split over the same devices instead of landing whole on a few of them."""
    return jax.tree.map(lambda x: x.reshape((x.shape[0] // n, n) + x.shape[1:]).swapaxes(0, 1), batch)


def _pool_micro_batches(stats: ForwardStats) -> ForwardStats:
    """Pool the statistics of micro-batches stacked along a leading axis ``A``: router statistics
    pool (``quantile_balancing.pool``), max logits take the max."""
    return ForwardStats(router={i: qb.pool(st) for i, st in stats.router.items()},
                        max_logits={i: jnp.max(m, axis=0) for i, m in stats.max_logits.items()})


def expert_imbalance(router_stats: dict) -> jax.Array:
    """Max/mean expert load ``[L]`` of each MoE layer, in ascending layer order (the layers of
    :func:`expert_imbalance_layers`), from ``model.forward``'s ``ForwardStats.router``."""
    if not router_stats:
        return jnp.zeros((0,), jnp.float32)
    return jnp.stack([qb.load_imbalance(router_stats[i]) for i in sorted(router_stats)])


def expert_imbalance_layers(cfg: ModelConfig) -> list[int]:
    """The layer index of each entry of the ``expert_imbalance`` metric (MoE layers with Quantile
    Balancing statistics)."""
    if cfg.moe.balancing != "quantile" or not cfg.moe.router_bias:
        return []
    return [i for i in range(cfg.num_layers) if cfg.ffn(i) == "moe"]


def make_train_step(graphdef, cfg: Config, *, state_shardings=None):
    """``step(state, batch) -> (state, metrics)`` over the split TrainState, jitted with donation.

    ``state_shardings`` (a tree of shardings like ``state``): the returned state keeps them, so every
    step runs one executable with its donated buffers reused in place. Left to XLA, the optimizer's
    outputs come back in other shardings on a multi-device mesh and the second step compiles again.

    batch: numpy/jax dict with ``tokens, segment_ids, positions, targets, loss_mask`` of shape
    ``[batch_size, seq_len]`` (plus ``image_*`` packed patches ``[batch_size, P, ...]`` for a vision
    model, ``k3jax.data.images``); split into ``train.grad_accum`` micro-batches. metrics: ``loss`` (mean
    nll per counted token), ``grad_norm`` (before clipping), ``tokens``, ``finite`` (False: the
    update was skipped), ``zero_gradient`` (True: an all-zero gradient, the state kept as it was),
    ``expert_imbalance [L]`` (max/mean expert load of each MoE layer, in the order of
    :func:`expert_imbalance_layers`, measured with the bias this step routed with).

    A LoRA run (``train.lora.rank > 0``) differentiates and updates only the adapters; the model's weights
    and its router biases stay as loaded (Quantile Balancing is off: the bias belongs to the base, and a
    PEFT adapter could not carry a changed one). Its input dropout draws from ``train.seed``, the
    optimizer step and the micro-batch, so a resumed run repeats it.
    """
    z_loss, tau = cfg.train.z_loss, cfg.train.optim.qk_clip_tau  # tau > 0: QK-clip of the MLA heads

    def next_token_objective(model, mb, lora_key):
        logits, _, stats = model.forward(mb["tokens"], segment_ids=mb["segment_ids"], positions=mb["positions"],
                                         images=vision_batch(mb), max_logits=tau > 0, lora_key=lora_key)
        with jax.named_scope("lm_head_loss"):
            total, count, nll = next_token_loss(logits, mb["targets"], mb["loss_mask"], z_loss)
        return total, count, nll, stats, {}

    return make_step(graphdef, cfg, next_token_objective, state_shardings=state_shardings)


def make_step(graphdef, cfg: Config, objective, *, per_count: bool = True, sum_names: tuple[str, ...] = (),
              state_shardings=None):
    """The train step of ``objective`` (:func:`make_train_step`'s next-token loss, or an RL policy loss,
    ``k3jax.rl.step``): gradient accumulation over ``train.grad_accum`` micro-batches, the optimizer update
    with the NaN guard, Quantile Balancing and QK-clip.

    ``objective(model, micro_batch, lora_key) -> (total, count, reported, ForwardStats, sums)``: the
    micro-batch's loss ``total`` (differentiated), its counted tokens, the summed value reported as
    ``loss``, the forward's statistics, and a dict of float32 scalars named ``sum_names``, summed over the
    micro-batches (returned in the metrics as they are). ``per_count``: gradients and ``loss`` are divided by the summed count (a
    mean per token); False: the totals are the loss already (an objective whose weights are global).
    """
    accum, grad_dtype = cfg.train.grad_accum, jnp.dtype(cfg.train.grad_dtype)
    top_k, balancing = cfg.model.moe.top_k, cfg.model.moe.balancing
    tau = cfg.train.optim.qk_clip_tau  # > 0: QK-clip of the MLA heads after every update
    lora = cfg.train.lora
    wrt_type = trainable(cfg)
    # The router bias is frozen in a LoRA run (it belongs to the base) and in RL (docs/design.md,
    # "Reinforcement learning": the rollout and the update route with the same bias)
    update_router_bias = balancing == "quantile" and not lora.enabled and not cfg.train.rl.enabled

    def micro_loss(params, rest, model_def, mb, lora_key):
        total, count, reported, stats, sums = objective(nnx.merge(model_def, params, rest), mb, lora_key)
        return total, (count, reported, stats, sums)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    out_shardings = None if state_shardings is None else (state_shardings, None)

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=out_shardings)
    def step(state, batch):
        ts = nnx.merge(graphdef, state)
        model_def, params, rest = nnx.split(ts.model, wrt_type, ...)

        # train.grad_dtype: the matrices differentiated (and their gradients accumulated) in that dtype
        wrt = params if grad_dtype == jnp.float32 else cast_muon_group(params, grad_dtype)
        step_key = None
        if lora.enabled and lora.dropout > 0:
            step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.train.seed), LORA_DROPOUT_STREAM),
                                          ts.optimizer.step[...])

        def body(carry, xs):
            mb, i = xs
            g_acc, count_acc, reported_acc, sums_acc = carry
            key = None if step_key is None else jax.random.fold_in(step_key, i)
            g, (count, reported, stats, sums) = grad_fn(wrt, rest, model_def, mb, key)
            return (jax.tree.map(jnp.add, g_acc, g), count_acc + count, reported_acc + reported,
                    jax.tree.map(jnp.add, sums_acc, sums)), stats

        zeros = jax.tree.map(jnp.zeros_like, wrt)
        mbs = _micro_batches(batch, accum)
        sums0 = {name: jnp.zeros((), jnp.float32) for name in sum_names}
        (grads, count, reported, sums), stats = jax.lax.scan(body, (zeros, 0.0, 0.0, sums0), (mbs, jnp.arange(accum)))
        stats = _pool_micro_batches(stats)
        norm = jnp.maximum(count, 1.0) if per_count else 1.0
        grads = jax.tree.map(lambda g: (g / norm).astype(g.dtype), grads)
        loss = reported / norm
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply(ts_state):
            ts_ = nnx.merge(graphdef, ts_state)
            with jax.named_scope("optimizer"):  # Newton-Schulz inside has its own scope
                ts_.optimizer.update(ts_.model, grads)
            if update_router_bias:
                with jax.named_scope("quantile_balancing"):
                    qb.apply(ts_.model, stats.router, top_k)
            if tau > 0:
                with jax.named_scope("optimizer"):
                    qk_clip(ts_.model, stats.max_logits, tau)
            return nnx.state(ts_)

        def skip(ts_state):
            ts_ = nnx.merge(graphdef, ts_state)
            ts_.skipped[...] += 1
            return nnx.state(ts_)

        # An all-zero gradient carries nothing to learn (an RL batch whose every group got one reward, a batch
        # of padding): the update would still move the weights by momentum and weight decay. The state is
        # kept as it is, the optimizer's count too; not a NaN-guard skip.
        zero = finite & (grad_norm == 0)
        new_state = jax.lax.switch(jnp.where(finite, jnp.where(zero, 1, 0), 2), (apply, lambda s: s, skip),
                                   nnx.state(ts))
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "finite": finite, "zero_gradient": zero,
                   "expert_imbalance": expert_imbalance(stats.router), **sums}
        return new_state, metrics

    return step


def make_eval_step(graphdef, cfg: Config):
    """``eval_step(state, batch) -> (summed nll, token count)``; jitted, no donation."""

    @jax.jit
    def eval_step(state, batch):
        model = nnx.merge(graphdef, state).model
        logits, _ = model(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                          images=vision_batch(batch))
        _, count, nll = next_token_loss(logits, batch["targets"], batch["loss_mask"])
        return nll, count

    return eval_step

