"""The two paths of the chunk kernels (TPU ``chunk.py`` and GPU ``chunk_gpu.py``): diagonal sub-tiles
formed densely (every 16-token sum of g above a bound) or with exact per-pair exponents, the
constants that decide between them, and the choice itself."""

import jax

from k3jax.ops import kda_chunk

# the sub-tile, the gate floor and the dense-path bound are the XLA op's (k3jax/ops/kda_chunk.py)
BC = kda_chunk.SUBTILE  # every causal tile is BC x BC
G_FLOOR = kda_chunk.G_FLOOR  # g is floored at -128 (exp underflows anyway)
DENSE_MIN_GS = kda_chunk.DENSE_MIN_SUM  # dense diagonal tiles need every sub-tile sum of g >= -80


def select_path(exact_flag, cfg, fn):
    """Run fn(exact) with the static choice (``cfg.exact``), or lax.cond on the run-time flag."""
    if cfg.exact is not None:
        return fn(cfg.exact)
    return jax.lax.cond(exact_flag, lambda: fn(True), lambda: fn(False))
