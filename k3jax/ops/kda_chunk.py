"""Intra-chunk algebra of chunkwise KDA as batched matmuls: anchored decay scores and the unit-lower solve.

Within a chunk of C tokens with chunk-local log-decay cumsum G ``[.., C, K]`` (``G_i = sum_{r<=i} g_r``,
g <= 0), chunkwise KDA needs score matrices

    A[i, j] = sum_d x_id k_jd exp(G_id - G_jd)        (j <= i; 0 above the diagonal)

for x = q and x = k. Forming the pairwise decays ``exp(G_i - G_j)`` costs ``C * C * K`` per chunk.
Here the chunk is split recursively into child blocks (C -> C/4 -> ... -> a leaf of at most 4 rows).
A pair (i, j) in different children a > b of one parent block factors through an *anchor*
``c_a = G`` at the row just before child a starts (research/kda.md §6.3; fla's sub-chunks):

    exp(G_i - G_j) = exp(G_i - c_a) * exp(c_a - e_b) * exp(e_b - G_j),    e_b = G at the end of child b

and every factor is <= 1 (each exponent is a sum of g over a forward range), so nothing can overflow
for any gate, and the product is a batched matmul per parent. Only the leaf pairs (i, j in one block of
<= 4 rows) are formed elementwise: ``4 * K`` numbers per token, not ``C * K``.

Accuracy: G is kept as an exact coarse part plus a small remainder (``split_cumsum``) and every exponent
above is a difference of two such pairs, so each exponent is accurate to ``eps * |exponent|`` however
large G itself grows (a plain cumsum would lose ``eps * |G|``).

All functions take any leading batch dims (``[..]``, e.g. ``[B, N, H]``) and are pure ``jnp``.
"""

import math

import jax
import jax.numpy as jnp

# fp32 matmuls at full precision: TPUs (bf16 passes) and GPUs (TF32) otherwise round the operands,
# and the delta rule feeds every rounding error back into the state.
PRECISION = jax.lax.Precision.HIGHEST
# Floor on the per-step log-decay: exp(-128) already underflows to 0 in float32 (so the recurrence is
# unchanged; in float64 the change is below 1e-55), and it bounds |chunk cumsum| by 128 * C.
G_FLOOR = -128.0
# Grid of the coarse part of g in split_cumsum: sums of multiples of 2**-8 below 2**16 in magnitude are
# exact in float32 (24-bit significand), i.e. for chunks of up to 511 tokens.
_G_GRID = 2.0**-8
LEAF = 4  # rows of the blocks whose pairwise decays are formed elementwise
MAX_CHUNK = 256  # split_cumsum's exactness bound (511), rounded down to a power of two


def split_cumsum(g, axis):
    """Cumsum of g (floored at ``G_FLOOR``) along ``axis`` as ``(G_hi, G_lo)``: ``G_hi`` exact, ``G_lo`` tiny.

    g is split into a part on a coarse grid, whose cumsum has no rounding at all, and the small
    remainder; so ``(G_hi_i - G_hi_j) + (G_lo_i - G_lo_j)`` is accurate to ``eps * |G_i - G_j|``. The
    gradient goes through the remainder, so d/dg is that of a plain cumsum.
    """
    g = jnp.maximum(g, G_FLOOR)
    g_hi = jax.lax.stop_gradient(jnp.round(g / _G_GRID) * _G_GRID)
    G_hi, G_lo = jnp.cumsum(jnp.stack([g_hi, g - g_hi]), axis=axis + 1)
    return G_hi, G_lo


def _sub(a, b):
    """Exponent ``a - b`` of two split cumsums ``(hi, lo)``, accurate to ``eps * |a - b|``."""
    return (a[0] - b[0]) + (a[1] - b[1])


def _rows(G, fn):
    """Apply fn to both halves of a split cumsum."""
    return fn(G[0]), fn(G[1])


def block_plan(C):
    """Parent block sizes, largest first, and the leaf size for a chunk of C rows (a power of two)."""
    if C & (C - 1):
        raise ValueError(f"the chunk must be a power of two, got {C}")
    parents, s = [], C
    while s > LEAF:
        parents.append(s)
        s //= 4 if s >= 4 * LEAF else 2
    return parents, s


def _leaf_scores(xs, k, G, leaf):
    """Scores inside blocks of ``leaf`` rows, elementwise: ``[n, .., C/leaf, leaf(i), leaf(j)]``, j <= i."""
    C, K = k.shape[-2:]
    blocks = lambda x: x.reshape(*x.shape[:-2], C // leaf, leaf, K)
    Gb = _rows(G, blocks)
    mask = jnp.tril(jnp.ones((leaf, leaf), bool))[..., None]  # [leaf(i), leaf(j), 1]
    diff = _sub(_rows(Gb, lambda x: x[..., :, None, :]), _rows(Gb, lambda x: x[..., None, :, :]))
    # above the diagonal the exponent is > 0 and could overflow: replaced before exp (the double where
    # keeps its gradient at 0, not NaN)
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)  # [.., C/leaf, leaf, leaf, K]
    kd = blocks(k)[..., None, :, :] * decay
    return jnp.stack([jnp.sum(blocks(x)[..., :, None, :] * kd, axis=-1) for x in xs])


def _parent_scores(xs, k, G, p, s):
    """Scores between different children (b < a) of each parent block of p rows, children of s rows,
    through the anchors: ``[n, .., C/p, m(a), s(i), m(b), s(j)]`` (zero for b >= a)."""
    C, K = k.shape[-2:]
    m = p // s
    # end of every child e_b and the anchor c_a (the end of the child before, 0 at the chunk start)
    ends = _rows(G, lambda x: x[..., s - 1::s, :])  # [.., C/s, K]
    anchors = _rows(ends, lambda x: jnp.pad(x[..., :-1, :], [(0, 0)] * (x.ndim - 2) + [(1, 0), (0, 0)]))
    children = lambda x: x.reshape(*x.shape[:-2], C // p, m, s, K)
    per_child = lambda x: x.reshape(*x.shape[:-2], C // p, m, 1, K)
    Gc = _rows(G, children)
    q_fac = jnp.exp(_sub(Gc, _rows(anchors, per_child)))  # exp(G_i - c_a) <= 1, [.., C/p, m, s, K]
    k_fac = jnp.exp(_sub(_rows(ends, per_child), Gc))  # exp(e_b - G_j) <= 1
    # exp(c_a - e_b) for b < a (<= 1), [.., C/p, m(a), m(b), K]
    a_of = _rows(anchors, lambda x: x.reshape(*x.shape[:-2], C // p, m, 1, K))
    b_of = _rows(ends, lambda x: x.reshape(*x.shape[:-2], C // p, 1, m, K))
    lower = jnp.tril(jnp.ones((m, m), bool), -1)[..., None]
    transfer = jnp.where(lower, jnp.exp(jnp.minimum(_sub(a_of, b_of), 0.0)), 0.0)
    keys = transfer[..., :, :, None, :] * (children(k) * k_fac)[..., None, :, :, :]  # [.., P, a, b, j, K]
    lhs = jnp.stack([children(x) * q_fac for x in xs])  # [n, .., P, a, i, K]
    return jnp.einsum("n...aid,...abjd->n...aibj", lhs, keys, precision=PRECISION)


def _block_diag(A, m):
    """``[.., P, m, s, s]`` diagonal blocks -> ``[.., P, m, s, m, s]`` (zeros off the diagonal)."""
    return A[..., :, :, :, None, :] * jnp.eye(m, dtype=A.dtype)[:, None, :, None]


def chunk_scores(xs, k, G):
    """Causal decay scores of every chunk: for each x in xs, ``A [.., C, C]`` with
    ``A_ij = sum_d x_id k_jd exp(G_id - G_jd)`` for j <= i and 0 above the diagonal.

    xs: a sequence of ``[.., C, K]``; k ``[.., C, K]``; G the chunk-local inclusive cumsum of g as a
    ``split_cumsum`` pair of ``[.., C, K]``; C a power of two. Returns a stacked ``[len(xs), .., C, C]``.
    """
    C = k.shape[-2]
    parents, leaf = block_plan(C)
    A = _leaf_scores(xs, k, G, leaf)  # [n, .., C/leaf, leaf, leaf]
    s = leaf
    for p in reversed(parents):  # bottom-up: each parent = its children on the diagonal + the anchored rest
        m = p // s
        A = A.reshape(*A.shape[:-3], C // p, m, s, s)
        A = (_parent_scores(xs, k, G, p, s) + _block_diag(A, m)).reshape(*A.shape[:-4], C // p, p, p)
        s = p
    return A.reshape(*A.shape[:-3], C, C)


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


def unit_lower_inverse(L, block=16):
    """``(I + L)^-1`` for strictly lower-triangular ``L [.., C, C]``, with batched matmuls only.

    The ``block x block`` diagonal blocks are inverted by doubling (``_doubling_inverse``), then block
    forward substitution fills the block rows: ``X_a = D_a^-1 (E_a - L_{a,<a} X_{<a})``. (LAPACK's
    batched triangular solve on XLA:CPU waits on its own thread pool and deadlocks on small machines;
    matmuls also suit TPUs.)
    """
    C = L.shape[-1]
    block = min(block, C)
    nb = C // block
    if nb * block != C:
        raise ValueError(f"the matrix size {C} must be a multiple of the block {block}")
    Lb = L.reshape(*L.shape[:-2], nb, block, nb, block)
    diag = jnp.stack([Lb[..., a, :, a, :] for a in range(nb)], axis=-3)  # [.., nb, block, block]
    D_inv = _doubling_inverse(diag)
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
