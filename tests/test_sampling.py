"""The nucleus (top-p) rule, written once in ``k3jax.inference.sampling.nucleus`` and used by ``generate``'s
``sample_logits`` and the server's per-row ``sample_rows``: it keeps exactly the smallest set of most
likely tokens whose probability reaches ``top_p`` (checked against a loop over the sorted tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.inference.sampling import nucleus, sample_logits


def kept_by_loop(row: np.ndarray, top_p: float) -> np.ndarray:
    """The plain rule: walk the tokens from the most likely, keeping each while the mass before it is
    below ``top_p`` (the most likely always stays); ``top_p >= 1`` keeps all."""
    if top_p >= 1.0:
        return np.ones(row.shape, bool)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    keep, mass = np.zeros(row.shape, bool), 0.0
    for i in np.argsort(-row, kind="stable"):
        if mass >= top_p:
            break
        keep[i] = True
        mass += probs[i]
    return keep


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (2, 3, 130)])
def test_nucleus_keeps_the_smallest_set_reaching_top_p(shape):
    rng = np.random.default_rng(sum(shape))
    logits = (rng.normal(size=shape) * rng.uniform(0.3, 4.0, size=shape[:-1] + (1,))).astype(np.float32)
    top_p = rng.choice([0.05, 0.3, 0.5, 0.9, 0.999, 1.0], size=shape[:-1] + (1,)).astype(np.float32)
    got = np.asarray(jax.jit(nucleus)(jnp.asarray(logits), jnp.asarray(top_p)))
    rows, ps = logits.reshape(-1, shape[-1]), top_p.reshape(-1)
    for row, p, out in zip(rows, ps, got.reshape(-1, shape[-1])):
        want = kept_by_loop(row.astype(np.float64), float(p))
        assert np.array_equal(np.isfinite(out), want), (p, np.isfinite(out).sum(), want.sum())
        assert np.array_equal(out[want], row[want])  # kept logits unchanged
    # one float top_p for all rows is the same rule
    scalar = np.asarray(jax.jit(nucleus, static_argnums=1)(jnp.asarray(logits), 0.5))
    for row, out in zip(rows, scalar.reshape(-1, shape[-1])):
        assert np.array_equal(np.isfinite(out), kept_by_loop(row.astype(np.float64), 0.5))


def test_sample_logits_draws_inside_the_nucleus():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)) * 3.0, jnp.float32)
    allowed = np.isfinite(np.asarray(nucleus(logits, 0.6)))
    keys = jax.random.split(jax.random.key(0), 64)
    draw = jax.jit(jax.vmap(lambda k: sample_logits(logits, k, temperature=1.0, top_p=0.6)))
    draws = np.asarray(draw(keys))  # [64, 4]
    assert all(allowed[r, draws[:, r]].all() for r in range(4))
    assert allowed[0].sum() > 1 and len(set(draws[:, 0])) > 1  # a real draw, not the argmax
    with pytest.raises(ValueError, match="top_p must be in"):
        sample_logits(logits, keys[0], temperature=1.0, top_p=0.0)
