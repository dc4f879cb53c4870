"""Intra-chunk algebra of chunkwise KDA as batched matmuls: anchored decay scores and the unit-lower solve.

Within a chunk of C tokens with chunk-local log-decay cumsum G ``[.., C, K]`` (``G_i = sum_{r<=i} g_r``,
g <= 0), chunkwise KDA needs score matrices

    A[i, j] = sum_d x_id k_jd exp(G_id - G_jd)        (j <= i; 0 above the diagonal)

for x = q and x = k. Forming the pairwise decays ``exp(G_i - G_j)`` costs ``C * C * K`` per chunk. Here
(as in fla's chunk kernels and ``pallas_kernels/kda/_math.py``) the chunk is split into sub-tiles of
``SUBTILE = 16`` rows. A pair (i, j) with i in sub-tile a and j in an earlier sub-tile b factors through
the *anchor* ``c_a = G`` at the row before sub-tile a (docs/kernels.md):

    exp(G_i - G_j) = exp(G_i - c_a) * exp(c_a - G_j),   both factors <= 1 (sums of g over forward ranges)

so the scores of sub-tile a's rows are one matmul against the keys scaled by ``exp(c_a - G_j)``: a
batched matmul over (chunk, sub-tile), with ``SUBTILE / C`` of the chunk's rows each, and the key
factors cost ``C / SUBTILE`` times the input, not ``C`` times. The diagonal sub-tiles (i, j in one
sub-tile) come in two ways:

- *dense* (every sub-tile's sum of g >= ``DENSE_MIN_SUM`` = -80, e.g. the K3 gate g >= -5): the same
  factorisation with ``exp(c_a - G_j) <= e^80``, finite in float32, so the whole chunk is that one
  batched matmul (fla's ``safe_gate``; the Pallas kernels' dense path);
- *exact* (any g <= 0, e.g. a softplus gate at -100): the sub-tile is split again into blocks of
  ``LEAF = 4`` rows with the same anchored factorisation between blocks, and inside a block the decay
  of a pair is the product of the per-step decays ``exp(g_t)`` over ``j < t <= i``: ``LEAF * K``
  numbers per token.

Accuracy: cumsums are kept as an exact coarse part plus a small remainder (``split``), so every exponent
formed as a difference is accurate to ``eps * |exponent|`` however large G grows (a plain cumsum would
lose ``eps * |G|``); the dense diagonal factors ``exp(-Gs_j) <= e^80`` lose up to ``80 eps`` (relative
5e-6) on those entries, which is why the gate decides the path.

All functions take any leading batch dims (``[..]``, e.g. ``[B, N, H]``) and are pure ``jnp``.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# fp32 matmuls at full precision: TPUs (bf16 passes) and GPUs (TF32) otherwise round the operands,
# and the delta rule feeds every rounding error back into the state.
PRECISION = jax.lax.Precision.HIGHEST
# Floor on the per-step log-decay: exp(-128) already underflows to 0 in float32 (so the recurrence is
# unchanged; in float64 the change is below 1e-55), and it bounds |chunk cumsum| by 128 * C.
G_FLOOR = -128.0
# Grid of the coarse part of g in split: sums of multiples of 2**-8 below 2**16 in magnitude are exact in
# float32 (24-bit significand), i.e. for chunks of up to 511 tokens.
_G_GRID = 2.0**-8
MAX_CHUNK = 256  # the grid's exactness bound (511), rounded down to a power of two
SUBTILE = 16  # rows of the anchored sub-tiles (fla's BC)
LEAF = 4  # rows of the exact path's innermost blocks
DENSE_MIN_SUM = -80.0  # dense diagonal sub-tiles need every sub-tile sum of g >= -80 (e^80 < float32 max)


def split(g):
    """g floored at ``G_FLOOR`` as ``(g_hi, g_lo)``: ``g_hi`` on a coarse grid (its sums are exact), ``g_lo``
    the small remainder; the gradient goes through ``g_lo``, so d/dg of any sum is that of g."""
    g = jnp.maximum(g, G_FLOOR)
    g_hi = jax.lax.stop_gradient(jnp.round(g / _G_GRID) * _G_GRID)
    return g_hi, g - g_hi


def _map(fn, *pairs):
    """Apply fn to the hi parts and to the lo parts of split values."""
    return tuple(fn(*xs) for xs in zip(*pairs))


def _value(x):
    return x[0] + x[1]


def _sub(a, b):
    """``a - b`` of two split values, accurate to ``eps * |a - b|``."""
    return (a[0] - b[0]) + (a[1] - b[1])


class ChunkGates(NamedTuple):
    """The gate of every chunk as sub-tile cumsums: ``Gs [.., NC, BC, K]`` (inclusive cumsum of g inside
    each sub-tile of BC rows) and ``P [.., NC, 1, K]`` (sum of g over the chunk's earlier sub-tiles), both
    split (hi, lo) pairs. The chunk-local cumsum is ``G = P + Gs``."""

    Gs: tuple
    P: tuple

    @classmethod
    def from_gate(cls, g):
        """g ``[.., C, K]`` (<= 0) with C a power of two <= ``MAX_CHUNK``."""
        C, K = g.shape[-2:]
        if C & (C - 1) or C > MAX_CHUNK:
            raise ValueError(f"the chunk must be a power of two <= {MAX_CHUNK}, got {C}")
        BC = min(SUBTILE, C)
        g = split(g.reshape(*g.shape[:-2], C // BC, BC, K))
        Gs = _map(lambda x: jnp.cumsum(x, axis=-2), g)
        P = _map(lambda x: jnp.cumsum(x, axis=-3) - x, _map(lambda x: x[..., -1:, :], Gs))
        return cls(Gs, P)

    @property
    def G(self):
        """Chunk-local inclusive cumsum, split, ``[.., NC, BC, K]``."""
        return _map(jnp.add, self.P, self.Gs)

    @property
    def G_last(self):
        """Sum of g over the chunk, split, ``[.., 1, 1, K]``."""
        return _map(lambda P, Gs: P[..., -1:, :, :] + Gs[..., -1:, -1:, :], self.P, self.Gs)

    @property
    def min_subtile_sum(self):
        """Smallest sum of g over one sub-tile (decides the dense path)."""
        return jnp.min(_value(self.Gs)[..., -1, :])


def _leaf_scores(xs, k, g, leaf):
    """Scores inside blocks of ``leaf`` rows from per-step decays: ``[n, .., R/leaf, leaf(i), leaf(j)]``.

    xs, k ``[.., R, K]``, g ``[.., R, K]`` (floored). The decay of pair j < i is ``prod_{j<t<=i} exp(g_t)``:
    a product of numbers <= 1 (relative error ``leaf * eps``, underflow only to a true ~0).
    """
    R, K = k.shape[-2:]
    blocks = lambda x: x.reshape(*x.shape[:-2], R // leaf, leaf, K)
    xb, kb, a = [blocks(x) for x in xs], blocks(k), jnp.exp(blocks(g))
    rows = []
    for i in range(leaf):
        cols, r = [], None  # r = decay from row j to row i
        for j in range(i, -1, -1):
            kd = kb[..., j, :] if r is None else kb[..., j, :] * r
            cols.append(jnp.stack([jnp.sum(x[..., i, :] * kd, axis=-1) for x in xb]))
            r = a[..., j, :] if r is None else r * a[..., j, :]
        cols = cols[::-1] + [jnp.zeros_like(cols[0])] * (leaf - 1 - i)
        rows.append(jnp.stack(cols, axis=-1))
    return jnp.stack(rows, axis=-2)


def _block_diag(A, m):
    """``[.., m, s, s]`` diagonal blocks -> ``[.., m, s, m, s]`` (zeros off the diagonal).

    Built by padding (its transpose is slicing): as a product with ``eye(m)`` its autodiff reduces over
    the small non-minor axis m, which XLA:CPU crashed on for some shapes.
    """
    widths = [(0, 0)] * (A.ndim - 3)
    return jnp.stack([jnp.pad(A[..., a, :, None, :], widths + [(0, 0), (a, m - 1 - a), (0, 0)]) for a in range(m)],
                     axis=-4)


def _anchored(xs, k, Gs, P, dense):
    """Scores of sub-tile rows against the keys of earlier sub-tiles (and of their own sub-tile when
    ``dense``) through the anchors ``P_a``: ``[n, .., NC, BC, NC * BC]``.

    xs, k ``[.., NC, BC, K]``; Gs the split cumsum inside each sub-tile, P the split cumsum before it
    ``[.., NC, 1, K]``.
    """
    A = _anchored_core(tuple(xs), k, *Gs, *P, dense)
    return jnp.stack(jnp.split(A, len(xs), axis=-2))


def _anchored_factors(k, Gs_hi, Gs_lo, P_hi, P_lo, dense):
    """``(q_fac [.., a, BC, K], k_fac [.., a, b, BC, K])``: ``exp(G_i - c_a)`` and ``exp(c_a - G_j)``."""
    NC = k.shape[-3]
    a_idx, b_idx = jnp.arange(NC)[:, None, None, None], jnp.arange(NC)[None, :, None, None]
    keep = (b_idx <= a_idx) if dense else (b_idx < a_idx)  # [NC(a), NC(b), 1, 1]
    # c_a - G_j = P_a - P_b - Gs_j (<= 0 for b < a; -Gs_j <= 80 on the dense diagonal), [.., a, b, BC, K]
    expo = _sub((P_hi[..., :, None, :, :], P_lo[..., :, None, :, :]),
                ((P_hi + Gs_hi)[..., None, :, :, :], (P_lo + Gs_lo)[..., None, :, :, :]))
    return jnp.exp(Gs_hi + Gs_lo), jnp.where(keep, jnp.exp(jnp.where(keep, expo, 0.0)), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _anchored_core(xs, k, Gs_hi, Gs_lo, P_hi, P_lo, dense):
    """``_anchored`` with the xs' rows concatenated: ``[.., NC, n * BC, NC * BC]``."""
    q_fac, k_fac = _anchored_factors(k, Gs_hi, Gs_lo, P_hi, P_lo, dense)
    NC, BC, K = k.shape[-3:]
    keys = (k[..., None, :, :, :] * k_fac).reshape(*k.shape[:-3], NC, NC * BC, K)  # [.., a, C, K]
    lhs = jnp.concatenate([x * q_fac for x in xs], axis=-2)  # [.., a, n * BC, K]: one matmul for all xs
    return jnp.einsum("...aik,...ajk->...aij", lhs, keys, precision=PRECISION)


def _anchored_core_fwd(xs, k, Gs_hi, Gs_lo, P_hi, P_lo, dense):
    return _anchored_core(xs, k, Gs_hi, Gs_lo, P_hi, P_lo, dense), (xs, k, Gs_hi, Gs_lo, P_hi, P_lo)


def _anchored_core_bwd(dense, res, dA):
    """Two matmuls back to the scaled operands, then the factors' chain rule (``d exp(e) = exp(e) de``);
    the exponent ``P_a - P_b - Gs_j`` hands its cotangent to P and Gs (hi and lo alike)."""
    xs, k, Gs_hi, Gs_lo, P_hi, P_lo = res
    q_fac, k_fac = _anchored_factors(k, Gs_hi, Gs_lo, P_hi, P_lo, dense)
    NC, BC, K = k.shape[-3:]
    kk = k[..., None, :, :, :] * k_fac  # [.., a, b, BC, K]
    lhs = jnp.concatenate([x * q_fac for x in xs], axis=-2)
    d_lhs = jnp.einsum("...aij,...ajk->...aik", dA, kk.reshape(*k.shape[:-3], NC, NC * BC, K), precision=PRECISION)
    d_keys = jnp.einsum("...aij,...aik->...ajk", dA, lhs, precision=PRECISION).reshape(kk.shape)
    d_lhs = jnp.split(d_lhs, len(xs), axis=-2)
    dxs = tuple(d * q_fac for d in d_lhs)
    d_expo = d_keys * kk  # [.., a, b, BC, K]
    # sums over the anchor axis a as adds of its NC slices (XLA:CPU's reduce over that small non-minor
    # axis crashed on some shapes, e.g. [1, 2, 2, a=2, b=2, 16, 16])
    over_a = lambda x: sum(x[..., a, :, :, :] for a in range(NC))  # [.., b, BC, K]
    dk = over_a(d_keys * k_fac)
    d_expo_b = over_a(d_expo)
    dGs = sum(d * x for d, x in zip(d_lhs, xs)) * q_fac - d_expo_b
    dP = jnp.sum(d_expo, axis=(-3, -2))[..., None, :] - jnp.sum(d_expo_b, axis=-2, keepdims=True)
    return dxs, dk, dGs, dGs, dP, dP


_anchored_core.defvjp(_anchored_core_fwd, _anchored_core_bwd)


def chunk_scores(xs, k, g):
    """Causal decay scores of every chunk: for each x in xs, ``A [.., C, C]`` with
    ``A_ij = sum_d x_id k_jd exp(G_id - G_jd)`` for j <= i and 0 above the diagonal.

    xs: a sequence of ``[.., C, K]``; k and g (the gate, <= 0) ``[.., C, K]``; C a power of two <=
    ``MAX_CHUNK``. Returns a stacked ``[len(xs), .., C, C]``. The dense or the exact diagonal sub-tiles
    are chosen at run time from the gate (``lax.cond``; both are compiled). The VJP recomputes the taken
    branch (so a ``cond`` under autodiff does not carry the other branch's residuals).
    """
    return _scores(tuple(xs), k, g)


def dense_ok(g):
    """Whether the dense diagonal sub-tiles are valid for the gate g ``[.., C, K]`` (a traced bool)."""
    return jax.lax.stop_gradient(ChunkGates.from_gate(g).min_subtile_sum >= DENSE_MIN_SUM)


def chunk_scores_on_path(xs, k, g, dense):
    """``chunk_scores`` with the path fixed by the Python bool ``dense``."""
    C, K = k.shape[-2:]
    BC = min(SUBTILE, C)
    NC = C // BC
    gates = ChunkGates.from_gate(g)
    sub = lambda x: x.reshape(*x.shape[:-2], NC, BC, K)
    xs, k_s = [sub(x) for x in xs], sub(k)
    A = _anchored(xs, k_s, gates.Gs, gates.P, dense)  # [n, .., NC, BC, C]
    if not dense:  # the diagonal sub-tiles: anchored LEAF-row blocks, per-step decays inside them
        leaf = min(LEAF, BC)
        m = BC // leaf
        Gl = _map(lambda x: x.reshape(*x.shape[:-2], m, leaf, K), gates.Gs)
        P_blk = _map(lambda x: jnp.pad(x[..., :-1, -1:, :], [(0, 0)] * (x.ndim - 3) + [(1, 0), (0, 0), (0, 0)]), Gl)
        Gs_blk = _map(jnp.subtract, Gl, P_blk)  # inclusive cumsum inside each block (exact hi part)
        blk = lambda x: x.reshape(*x.shape[:-2], m, leaf, K)
        between = _anchored([blk(x) for x in xs], blk(k_s), Gs_blk, P_blk, False)  # [n, .., NC, m, leaf, BC]
        inside = _leaf_scores(xs, k_s, _value(split(sub(g))), leaf)  # [n, .., NC, m, leaf, leaf]
        diag = (between.reshape(*between.shape[:-3], m, leaf, m, leaf) + _block_diag(inside, m))
        A = A + _block_diag(diag.reshape(*diag.shape[:-4], BC, BC), NC).reshape(A.shape)
    # the dense path leaves finite junk above the diagonal of its diagonal sub-tiles
    return jnp.where(jnp.tril(jnp.ones((C, C), bool)), A.reshape(*A.shape[:-3], C, C), 0.0)


@jax.custom_vjp
def _scores(xs, k, g):
    return _scores_fwd(xs, k, g)[0]


def _scores_fwd(xs, k, g):
    dense = dense_ok(g)
    A = jax.lax.cond(dense, lambda *a: chunk_scores_on_path(*a, True), lambda *a: chunk_scores_on_path(*a, False), xs, k, g)
    return A, (xs, k, g, dense)


def _scores_bwd(res, dA):
    xs, k, g, dense = res
    vjp = lambda d: lambda xs, k, g, dA: jax.vjp(lambda *a: chunk_scores_on_path(*a, d), xs, k, g)[1](dA)
    return jax.lax.cond(dense, vjp(True), vjp(False), xs, k, g, dA)


_scores.defvjp(_scores_fwd, _scores_bwd)


def _doubling_inverse(L):
    """``(I + L)^-1`` for strictly lower-triangular ``L [.., n, n]``: ``N = -L`` is nilpotent, so
    ``(I - N)^-1 = (I + N)(I + N^2)(I + N^4)...`` (``ceil(log2 n)`` factors; matmuls only)."""
    n = L.shape[-1]
    N = -L
    inv = jnp.eye(n, dtype=L.dtype) + N
    power = N
    for _ in range(max(math.ceil(math.log2(max(n, 1))), 1) - 1):
        power = jnp.einsum("...ij,...jk->...ik", power, power, precision=PRECISION)
        inv = inv + jnp.einsum("...ij,...jk->...ik", inv, power, precision=PRECISION)
    return inv


@jax.custom_vjp
def unit_lower_inverse(L):
    """``X = (I + L)^-1`` for strictly lower-triangular ``L [.., C, C]`` (zeros on and above the diagonal),
    with batched matmuls only.

    The ``SUBTILE`` diagonal blocks are inverted by doubling (``_doubling_inverse``), then block forward
    substitution fills the block rows: ``X_a = D_a^-1 (E_a - L_{a,<a} X_{<a})``. (LAPACK's batched
    triangular solve on XLA:CPU waits on its own thread pool and deadlocks on small machines; matmuls
    also suit TPUs.) Gradient: ``dL = -tril(X^T dX X^T, -1)``.
    """
    C = L.shape[-1]
    block = min(SUBTILE, C)
    nb = C // block
    Lb = L.reshape(*L.shape[:-2], nb, block, nb, block)
    D_inv = _doubling_inverse(jnp.stack([Lb[..., a, :, a, :] for a in range(nb)], axis=-3))  # [.., nb, bl, bl]
    eye = jnp.eye(C, dtype=L.dtype)
    rows = []
    for a in range(nb):
        rhs = eye[a * block:(a + 1) * block]  # [block, C]
        if a:
            done = jnp.concatenate(rows, axis=-2)  # [.., a * block, C]
            rhs = rhs - jnp.einsum("...ij,...jc->...ic", L[..., a * block:(a + 1) * block, :a * block], done,
                                   precision=PRECISION)
        rows.append(jnp.einsum("...ij,...jc->...ic", D_inv[..., a, :, :], rhs, precision=PRECISION))
    return jnp.concatenate(rows, axis=-2)


def _unit_lower_inverse_fwd(L):
    X = unit_lower_inverse(L)
    return X, X


def _unit_lower_inverse_bwd(X, dX):
    XT = jnp.swapaxes(X, -1, -2)
    dL = -jnp.einsum("...ij,...jk,...kl->...il", XT, dX, XT, precision=PRECISION)
    return (jnp.tril(dL, -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)
