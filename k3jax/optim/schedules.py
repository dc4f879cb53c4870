"""Learning-rate schedules: warmup, then cosine, warmup-stable-decay (wsd) or constant."""

import jax.numpy as jnp
import optax

from k3jax.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """LR at (0-based) optimizer step ``s``; a jittable function of ``s``.

    - warmup (all schedules): ``peak * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (the first
      step already moves; the peak is reached at step ``warmup_steps - 1``).
    - ``cosine``: from ``peak`` at step ``warmup`` to ``end = end_lr_fraction * peak`` at step
      ``warmup + D`` along a half cosine, then ``end``; ``D = decay_steps`` or, when 0, the rest of
      the run (``total_steps - warmup``).
    - ``wsd`` (warmup-stable-decay): ``peak`` until ``total_steps - D``, then linear to ``end`` at
      ``total_steps``; ``D = decay_steps`` or, when 0, 20% of ``total_steps``.
    - ``constant``: ``peak`` after warmup.
    """
    peak = cfg.learning_rate if peak is None else peak
    end = cfg.end_lr_fraction * peak
    warmup = cfg.warmup_steps
    kind = cfg.schedule
    if kind == "cosine":
        decay = cfg.decay_steps or max(total_steps - warmup, 1)
        decay_start = warmup
    elif kind == "wsd":
        decay = cfg.decay_steps or max(int(round(0.2 * total_steps)), 1)
        decay_start = max(total_steps - decay, warmup)
    elif kind == "constant":
        decay, decay_start = 1, None
    else:
        raise ValueError(f"train.optim.schedule: unknown schedule {kind!r} (cosine, wsd, constant)")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((s + 1.0) / max(warmup, 1), 1.0) if warmup > 0 else jnp.asarray(peak, jnp.float32)
        if decay_start is None:
            return warm
        p = jnp.clip((s - decay_start) / decay, 0.0, 1.0)
        if kind == "cosine":
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        else:
            after = peak + (end - peak) * p
        return jnp.where(s < warmup, warm, after)

    return schedule



__all__ = ["learning_rate_schedule"]
