"""Per-chunk KDA algebra on in-register values, shared by the forward and backward kernels.

Everything here works on one chunk of one (batch, head): ``C`` tokens split into ``C // BC`` sub-tiles of
``BC = 16`` tokens. The log-decay arrives as ``Gs``, the *sub-tile-local* inclusive cumsum of g
(``Gs_i = sum of g over the rows of i's sub-tile up to and including i``), so every exponent below is
formed from short same-sign sums and stays accurate to ``eps * |exponent|`` for any g <= 0 (a plain
chunk cumsum would lose ``eps * |G|`` when G is large and ``G_i - G_j`` small).

Anchors (docs/kernels.md): sub-tile ``a``'s anchor is the chunk cumsum at the row *before* its first
row, ``c_a = G_{a*BC - 1}`` (``0`` for a = 0), i.e. strictly in the causal past of every row of the
sub-tile and fixed. The score between query row ``i`` (sub-tile a) and key row ``j`` (sub-tile b) is

    exp(G_i - G_j) = exp(G_i - c_a) * exp(c_a - G_j) = exp(Gs_i) * exp(c_a - G_j)

- ``b < a``: ``c_a - G_j = sum_{s=b+1}^{a-1} tot_s + (tot_b - Gs_j) <= 0`` (``tot_s`` = the total of
  sub-tile s): both factors are <= 1, a dense matmul for any g.
- ``b == a`` (diagonal tile): ``exp(-Gs_j) >= 1``. With a lower-bounded gate (g >= -5, so
  ``-Gs_j <= 80``) it stays finite in fp32/bf16 (``e^80 ~ 5.5e34``) and the tile is a dense matmul
  too ("dense" path). Otherwise the tile is formed elementwise with exact per-pair exponents
  ``exp(min(Gs_i - Gs_j, 0))`` ("exact" path, 16 columns at a time on the VPU).

Matmul operands go to the MXU in ``mmdt`` (the input dtype: bf16 -> bf16 operands, fp32 -> fp32 at
HIGHEST precision), always with fp32 accumulation. The unit-lower-triangular solve runs in fp32.
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import BF16_3X, HIGHEST, mm

F32 = jnp.float32


def inv_precision(mmdt):
    """Precision of the triangular-inverse matmuls: fp32 (HIGHEST) for fp32 inputs, bf16_3x for bf16."""
    return HIGHEST if mmdt == F32 else BF16_3X


def iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def blk(x, s, BC):
    """Rows of sub-tile s."""
    return x[s * BC:(s + 1) * BC]


class Tiles:
    """Gate-derived per-chunk quantities (all fp32, [C, K] unless noted)."""

    def __init__(self, Gs, C, BC):
        self.C, self.BC, self.NC = C, BC, C // BC
        self.Gs = Gs
        self.tot = [Gs[s * BC + BC - 1:s * BC + BC, :] for s in range(self.NC)]  # [1, K] each, <= 0

    def ssum(self, lo, hi):
        """``sum_{s=lo}^{hi-1} tot_s`` as [1, K] (zeros when empty): a same-sign sum, accurate."""
        acc = jnp.zeros_like(self.tot[0])
        for s in range(lo, hi):
            acc = acc + self.tot[s]
        return acc

    def rows(self, parts):
        return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    @property
    def G(self):
        """Chunk-local cumsum G_i = sum_{r<=i} g_r."""
        return self.rows([blk(self.Gs, s, self.BC) + self.ssum(0, s) for s in range(self.NC)])

    @property
    def G_last(self):
        return self.ssum(0, self.NC)  # [1, K]

    def ekl(self):
        """``exp(tot_b - Gs_j)``: decay from row j to the end of its own sub-tile (<= 1)."""
        return self.rows([jnp.exp(self.tot[s] - blk(self.Gs, s, self.BC)) for s in range(self.NC)])

    def k_end(self, ekl):
        """``exp(G_last - G_j)`` (<= 1)."""
        return self.rows([blk(ekl, s, self.BC) * jnp.exp(self.ssum(s + 1, self.NC)) for s in range(self.NC)])

    def key_factor(self, a, ekl, exact):
        """[C, K] multiplier of the keys for query sub-tile a (anchor c_a); zero on future sub-tiles.

        Diagonal tile: ``exp(-Gs_j)`` on the dense path, 0 on the exact path (added separately).
        """
        BC, parts = self.BC, []
        zero = jnp.zeros((BC, self.Gs.shape[1]), F32)
        for b in range(self.NC):
            if b < a:
                parts.append(blk(ekl, b, BC) * jnp.exp(self.ssum(b + 1, a)))
            elif b == a and not exact:
                parts.append(jnp.exp(-blk(self.Gs, b, BC)))
            else:
                parts.append(zero)
        return self.rows(parts)


def exact_diag_tile(tl, a, lhs, k):
    """Exact diagonal tile for sub-tile a: ``[BC(i), C]`` with ``sum_d lhs_id k_jd exp(min(Gs_i - Gs_j, 0))``
    in columns ``j`` of sub-tile a (zeros elsewhere). lhs: [BC, K] rows of sub-tile a."""
    BC, C = tl.BC, tl.C
    Gs_a = blk(tl.Gs, a, BC)
    e = jnp.exp(jnp.minimum(Gs_a[:, None, :] - Gs_a[None, :, :], 0.0))  # [BC(i), BC(j), K]
    tile = jnp.sum(lhs[:, None, :] * blk(k, a, BC)[None, :, :] * e, axis=-1)  # [BC, BC]
    return mm(tile, placement(a, BC, C))


def placement(a, BC, C):
    """[BC, C] 0/1 matrix moving a BC-wide tile to columns a*BC.. (an exact matmul, no lane shuffles)."""
    r, c = iota((BC, C), 0), iota((BC, C), 1)
    return (c == r + a * BC).astype(F32)


def scores(tl, q, kb, k, exact, mmdt):
    """Causal score matrices (before masking): ``A_qk[i, j] = sum_d q_id k_jd exp(G_id - G_jd)`` and
    ``A_kk`` likewise with ``kb = beta * k`` on the left; both [C, C] fp32, valid for j <= i."""
    BC, NC = tl.BC, tl.NC
    ekl = tl.ekl()
    eq = jnp.exp(tl.Gs)
    aq, ak = [], []
    for a in range(NC):
        KF = (k * tl.key_factor(a, ekl, exact)).astype(mmdt)
        ea = blk(eq, a, BC)
        lhs = jnp.concatenate([blk(q, a, BC) * ea, blk(kb, a, BC) * ea], axis=0)  # q and kb rows: one matmul
        sa = mm(lhs.astype(mmdt), KF, trans_b=True)  # [2 BC, C]
        sq, sk = sa[:BC], sa[BC:]
        if exact:
            sq = sq + exact_diag_tile(tl, a, blk(q, a, BC), k)
            sk = sk + exact_diag_tile(tl, a, blk(kb, a, BC), k)
        aq.append(sq)
        ak.append(sk)
    return tl.rows(aq), tl.rows(ak), ekl


def unit_lower_inverse(L, C, BC, precision=HIGHEST):
    """``(I + L)^-1`` for strictly lower-triangular L [C, C] (fp32, matmuls only).

    Block-diagonal 16x16 part by doubling, ``(I+N)(I+N^2)(I+N^4)(I+N^8)`` with N = -L_diag (exact: N^16
    = 0; at most 15 powers, so cancellation stays bounded), then the strictly block-lower remainder
    ``M = D^-1 L_off`` (nilpotent of index C/BC) the same way: ``(I + L)^-1 = (I + M)^-1 D^-1``.
    This equals block forward substitution up to rounding, with no row-serial steps. precision: HIGHEST
    (fp32 inputs) or bf16_3x (bf16 inputs: ~2^-16 relative, far below the bf16 noise).
    """
    mm_ = lambda a, b: mm(a, b, precision=precision)
    r, c = iota((C, C), 0), iota((C, C), 1)
    eye = (r == c).astype(F32)
    same = (r // BC) == (c // BC)
    N = -jnp.where(same, L, 0.0)
    P, Np = eye + N, N
    for _ in range(max(0, math.ceil(math.log2(BC)) - 1)):
        Np = mm_(Np, Np)
        P = P + mm_(P, Np)
    NC = C // BC
    if NC == 1:
        return P
    Mn = -mm_(P, jnp.where(same, 0.0, L))
    Q = eye + Mn
    for _ in range(max(0, math.ceil(math.log2(NC)) - 1)):
        Mn = mm_(Mn, Mn)
        Q = Q + mm_(Q, Mn)
    return mm_(Q, P)


def masks(C, seg):
    """``(causal_incl, causal_strict)`` bool [C, C]; seg = the segment matrix (see seg_vectors) or None."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    incl, strict = r >= c, r > c
    if seg is not None:
        same = (seg > 0.5) | (r == c)
        incl, strict = incl & same, strict & same
    return incl, strict


def seg_vectors(C, seg):
    """``(reads_state [C,1], in_last [C,1], no_reset [1,1])`` as fp32 0/1 (ones without segments).

    seg [C, C]: off the diagonal 1 where tokens i and j are in the same segment; on the diagonal 1 where
    token i still belongs to the segment of the incoming state (no reset at or before i in the chunk).
    """
    if seg is None:
        one_c = jnp.ones((C, 1), F32)
        return one_c, one_c, jnp.ones((1, 1), F32)
    r, c = iota((C, C), 0), iota((C, C), 1)
    reads_state = jnp.sum(jnp.where(r == c, seg, 0.0), axis=1, keepdims=True)
    in_last = jnp.where(iota((C, 1), 0) == C - 1, 1.0, seg[:, C - 1:C])
    return reads_state, in_last, seg[C - 1:C, C - 1:C]


def row_to_col(x):
    """[1, K] -> [K, 1] (via an (8, K) tile transpose, which Mosaic supports)."""
    return jnp.transpose(jnp.broadcast_to(x, (8, x.shape[1])))[:, 0:1]


def chunk_forward(q, k, kb, vb, Gs, seg, S, *, BC, exact, mmdt):
    """One chunk: returns ``(o [C, V], S_new [K, V])`` in fp32.

    q is already scaled; kb = beta*k, vb = beta*v; S the fp32 state [K, V] entering the chunk.
    """
    C = q.shape[0]
    tl = Tiles(Gs, C, BC)
    A_qk, A_kk, ekl = scores(tl, q, kb, k, exact, mmdt)
    incl, strict = masks(C, seg)
    A_qk = jnp.where(incl, A_qk, 0.0)
    L = jnp.where(strict, A_kk, 0.0)
    inv = unit_lower_inverse(L, C, BC, inv_precision(mmdt))
    rs, in_last, no_reset = seg_vectors(C, seg)
    eG = jnp.exp(tl.G)
    inv_m = inv.astype(mmdt)
    U = mm(inv_m, vb.astype(mmdt))
    W = mm(inv_m, (eG * kb * rs).astype(mmdt))
    qg = q * eG * rs
    S_m = S.astype(mmdt)
    delta = U - mm(W.astype(mmdt), S_m)
    o = mm(qg.astype(mmdt), S_m) + mm(A_qk.astype(mmdt), delta.astype(mmdt))
    k_out = k * tl.k_end(ekl) * in_last
    d = row_to_col(jnp.exp(tl.G_last) * no_reset)
    S_new = S * d + mm(k_out.astype(mmdt), delta.astype(mmdt), trans_a=True)
    return o, S_new


def chunk_backward(q, k, kb, vb, Gs, seg, S, dO, dSp, *, BC, exact, mmdt):
    """VJP of ``chunk_forward`` for one chunk.

    q is already scaled; S the state entering the chunk, dO the output cotangent [C, V] and dSp the
    cotangent of the state leaving the chunk [K, V]. Returns ``(dq, dk, dkb, dvb, dGs, dS)``: the first
    five [C, *] (dq with respect to the *scaled* q, dGs with respect to the sub-tile cumsum) and dS the
    cotangent of the entering state [K, V], all fp32.

    Score matrices ``A[i, j] = sum_d x_id k_jd exp(G_id - G_jd)`` (x = q or kb) back-propagate as
    ``dx = (dA K-factors)``, ``dk = (dA^T x-factors)`` with the forward's anchors, and
    ``dG = x * dx - k * dk`` (the exponent's derivative), so no extra exponentials are needed.
    """
    C = q.shape[0]
    NC = C // BC
    tl = Tiles(Gs, C, BC)
    ekl = tl.ekl()
    eq = jnp.exp(Gs)
    # ---- recompute the forward
    factors = [tl.key_factor(a, ekl, exact) for a in range(NC)]
    KFs = [(k * F).astype(mmdt) for F in factors]
    xq = [blk(q, a, BC) * blk(eq, a, BC) for a in range(NC)]
    xk = [blk(kb, a, BC) * blk(eq, a, BC) for a in range(NC)]
    aq, ak = [], []
    for a in range(NC):
        sa = mm(jnp.concatenate([xq[a], xk[a]], axis=0).astype(mmdt), KFs[a], trans_b=True)
        sq, sk = sa[:BC], sa[BC:]
        if exact:
            sq = sq + exact_diag_tile(tl, a, blk(q, a, BC), k)
            sk = sk + exact_diag_tile(tl, a, blk(kb, a, BC), k)
        aq.append(sq)
        ak.append(sk)
    incl, strict = masks(C, seg)
    A_qk = jnp.where(incl, tl.rows(aq), 0.0)
    L = jnp.where(strict, tl.rows(ak), 0.0)
    inv = unit_lower_inverse(L, C, BC, inv_precision(mmdt))
    rs, in_last, no_reset = seg_vectors(C, seg)
    eG = jnp.exp(tl.G)
    inv_m = inv.astype(mmdt)
    vb_m = vb.astype(mmdt)
    Wr = eG * kb * rs
    U = mm(inv_m, vb_m)
    W = mm(inv_m, Wr.astype(mmdt))
    Qg = q * eG * rs
    S_m = S.astype(mmdt)
    delta = U - mm(W.astype(mmdt), S_m)
    delta_m = delta.astype(mmdt)
    k_end = tl.k_end(ekl)
    k_out = k * k_end * in_last
    dvec = jnp.exp(tl.G_last) * no_reset  # [1, K]

    # ---- state update S' = Diag(d) S + k_out^T delta
    dO_m = dO.astype(mmdt)
    dSp_m = dSp.astype(mmdt)
    dk_out = mm(delta_m, dSp_m, trans_b=True)  # [C, K]
    ddelta = mm(k_out.astype(mmdt), dSp_m)  # [C, V]
    dG_last = mm(jnp.ones((8, S.shape[1]), F32), S * dSp, trans_b=True)[0:1] * dvec  # [1, K]
    dS = dSp * row_to_col(dvec)
    # ---- output o = Qg S + A_qk delta
    dQg = mm(dO_m, S_m, trans_b=True)  # [C, K]
    dS = dS + mm(Qg.astype(mmdt), dO_m, trans_a=True)
    dA_qk = jnp.where(incl, mm(dO_m, delta_m, trans_b=True), 0.0)  # [C, C]
    ddelta = ddelta + mm(A_qk.astype(mmdt), dO_m, trans_a=True)
    # ---- delta = U - W S
    ddelta_m = ddelta.astype(mmdt)
    dW = -mm(ddelta_m, S_m, trans_b=True)  # [C, K]
    dS = dS - mm(W.astype(mmdt), ddelta_m, trans_a=True)
    # ---- U = Inv vb, W = Inv Wr, Inv = (I + L)^-1
    dvb = mm(inv_m, ddelta_m, trans_a=True)
    dWr = mm(inv_m, dW.astype(mmdt), trans_a=True)
    prec = inv_precision(mmdt)
    dInv = mm(ddelta, vb.astype(F32), trans_b=True, precision=prec) + mm(dW, Wr, trans_b=True, precision=prec)
    dL = jnp.where(strict, -mm(mm(inv, dInv, trans_a=True, precision=prec), inv, trans_b=True, precision=prec), 0.0)
    # ---- elementwise factors
    dq = dQg * eG * rs
    dkb = dWr * eG * rs
    dk = dk_out * k_end * in_last
    dG = dWr * Wr + dQg * Qg - dk_out * k_out
    dG_last = dG_last + jnp.sum(dk_out * k_out, axis=0, keepdims=True)
    # ---- scores
    dq_s, dkb_s, dk_s = [], [], jnp.zeros_like(k)
    dAq_m, dL_m = dA_qk.astype(mmdt), dL.astype(mmdt)
    for a in range(NC):
        dAa, dLa = blk(dAq_m, a, BC), blk(dL_m, a, BC)  # [BC, C]
        ea = blk(eq, a, BC)
        dxq = ea * mm(dAa, KFs[a])
        dxk = ea * mm(dLa, KFs[a])
        dKF = mm(dAa, xq[a].astype(mmdt), trans_a=True) + mm(dLa, xk[a].astype(mmdt), trans_a=True)  # [C, K]
        dk_a = dKF * factors[a]
        if exact:
            P = placement(a, BC, C)
            tq = mm(blk(dA_qk, a, BC), P, trans_b=True)  # [BC, BC] diagonal tile
            tk_ = mm(blk(dL, a, BC), P, trans_b=True)
            Gs_a = blk(Gs, a, BC)
            E = jnp.exp(jnp.minimum(Gs_a[:, None, :] - Gs_a[None, :, :], 0.0))  # [i, j, K]
            k_a = blk(k, a, BC)
            eq3, ek3 = tq[:, :, None] * E, tk_[:, :, None] * E
            dxq = dxq + jnp.sum(eq3 * k_a[None, :, :], axis=1)
            dxk = dxk + jnp.sum(ek3 * k_a[None, :, :], axis=1)
            diag_dk = (jnp.sum(eq3 * blk(q, a, BC)[:, None, :], axis=0)
                       + jnp.sum(ek3 * blk(kb, a, BC)[:, None, :], axis=0))  # [BC(j), K]
            dk_a = dk_a + mm(P, diag_dk, trans_a=True)  # rows of sub-tile a
        dq_s.append(dxq)
        dkb_s.append(dxk)
        dk_s = dk_s + dk_a
    dq_s, dkb_s = tl.rows(dq_s), tl.rows(dkb_s)
    dq, dkb, dk = dq + dq_s, dkb + dkb_s, dk + dk_s
    dG = dG + q * dq_s + kb * dkb_s - k * dk_s
    # ---- G -> Gs: G_i = Gs_i + sum_{s < sub-tile(i)} tot_s, G_last = sum_s tot_s
    r = iota((C, 1), 0)
    dG = dG + jnp.where(r == C - 1, dG_last, 0.0)
    sums = [jnp.sum(blk(dG, a, BC), axis=0, keepdims=True) for a in range(NC)]
    dGs = dG
    for s in range(NC - 1):
        suffix = sums[s + 1]
        for a in range(s + 2, NC):
            suffix = suffix + sums[a]
        dGs = dGs + jnp.where(r == s * BC + BC - 1, suffix, 0.0)
    return dq, dk, dkb, dvb, dGs, dS
