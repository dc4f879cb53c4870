"""Per-chunk KDA algebra on lists of 16-token sub-tiles, for kernels that cannot slice or concatenate
in-register arrays (Pallas Triton; also valid in interpret mode and on any other backend).

Same mathematics, anchors and numerics as ``_math.chunk_forward`` / ``_math.chunk_backward`` (read their
docstrings first), but a chunk of ``C = NC * BC`` tokens is never one ``[C, *]`` value: every quantity is
a Python list of ``NC`` per-sub-tile values (``[BC, *]`` rows), and every ``[C, C]`` matrix is a dict of
its lower-triangular ``[BC, BC]`` tiles ``{(a, b): tile}`` with ``b <= a``. Triton's tensors are
power-of-two register blocks with no slicing, no row concatenation and 2-D ``tl.dot`` of at least
16 x 16, so this form needs only loads of sub-tiles from refs, elementwise ops, 2-D dots, row/column
reductions and ``[1, K] <-> [K, 1]`` reshapes. The strictly-upper tiles (all zero) are never formed,
which also halves the score and inverse work of the full-chunk form.

The chunk's work is split as the GPU kernels split it (``chunk_gpu.py``): ``intra`` is everything that
needs no state (scores, inverse, W, the gate factors), ``wy_values`` the values' share U; the state
recurrence and the output are plain ``[C, *]`` matmuls in their own kernels; the backward's state-dependent
products are summed over V blocks by ``v_block_backward`` and turned into dq, dk, d(beta k), dGs by
``intra_backward``.

Anchors (docs/kernels.md): the score between query row ``i`` of sub-tile ``a`` and key row ``j`` of
sub-tile ``b <= a`` is ``exp(Gs_i) * F_ab[j]`` with ``F_ab = exp(c_a - G_j)`` and the anchor ``c_a`` the chunk
cumsum at the row before sub-tile ``a`` (causal past, fixed): ``F_ab <= 1`` for ``b < a``; on the diagonal
``F_aa = exp(-Gs_j)`` (dense path, needs every 16-token sum of g >= -80, e.g. the K3 gate g > -5) or the
tile is formed with exact per-pair exponents (``exact``, any g <= 0).

Matmul operands are ``mmdt`` (bf16 inputs -> bf16 operands; fp32 -> fp32 at HIGHEST precision) with
fp32 accumulation; the state, the gate algebra and the 16 x 16 triangular solves run in fp32
(``_math.inv_precision``: HIGHEST for fp32 inputs, bf16_3x for bf16 inputs).
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, mm
from pallas_kernels.kda._math import inv_precision, iota, unit_lower_inverse

F32 = jnp.float32


@dataclasses.dataclass
class Segments:
    """Packed-document data of one chunk, per sub-tile (all fp32 0/1 or counts).

    cnt: NC x [BC, 1] running count of resets (two tokens share a segment iff their counts are equal);
    reads_state: NC x [BC, 1] 1 where no reset happens at or before the token inside the chunk;
    in_last: NC x [BC, 1] 1 where the token is in the segment of the chunk's last token;
    no_reset: [1, 1] reads_state of the chunk's last token (the incoming state survives the chunk).
    """

    cnt: list
    reads_state: list
    in_last: list
    no_reset: object


@dataclasses.dataclass
class Chunk:
    """One chunk of one (batch, head), as NC sub-tiles.

    q: [BC, K] fp32, already scaled; k, kb (= beta * k): [BC, K] fp32; vb (= beta * v): [BC, V] in mmdt (None
    where a kernel reads it V block by V block);
    Gs: [BC, K] fp32 sub-tile-local inclusive cumsum of g; tot: [1, K] fp32 the last row of each Gs
    (the sub-tile's total); seg: ``Segments`` or None; pieces (exact path only): per sub-tile a list of
    ``(q, k, kb, Gs)`` column pieces ``[BC, KP]`` covering K, for the ``[BC, BC, KP]`` exact diagonal tiles.
    """

    q: list
    k: list
    kb: list
    vb: list
    Gs: list
    tot: list
    seg: Segments | None = None
    pieces: list | None = None

    @property
    def NC(self):
        return len(self.q)

    @property
    def BC(self):
        return self.q[0].shape[0]


def _sum(terms):
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def col(x):
    """[1, K] -> [K, 1] (a reshape: same element order)."""
    return x.reshape(x.shape[1], 1)


def row(x):
    """[K, 1] -> [1, K]."""
    return x.reshape(1, x.shape[0])


def colsum(x):
    """Sum over rows: [R, K] -> [1, K]."""
    return jnp.sum(x, axis=0).reshape(1, x.shape[1])


class Gate:
    """Gate-derived factors of one chunk (fp32, [BC, K] per sub-tile unless noted); see _math.Tiles."""

    def __init__(self, ch: Chunk):
        self.ch, self.NC = ch, ch.NC
        self.eq = [jnp.exp(g) for g in ch.Gs]  # exp(Gs_i) <= 1
        self.eG = [jnp.exp(ch.Gs[a] + self.ssum(0, a)) for a in range(self.NC)]  # exp(G_i), G = chunk cumsum
        self.ekl = [jnp.exp(ch.tot[b] - ch.Gs[b]) for b in range(self.NC)]  # decay to the end of j's sub-tile
        self.k_end = [self.ekl[b] * jnp.exp(self.ssum(b + 1, self.NC)) for b in range(self.NC)]  # exp(G_last - G_j)
        self.G_last = self.ssum(0, self.NC)  # [1, K]

    def ssum(self, lo, hi):
        """``sum_{s=lo}^{hi-1} tot_s`` as [1, K] (zeros when empty): a same-sign sum, accurate."""
        tot = self.ch.tot
        return _sum(tot[lo:hi]) if hi > lo else jnp.zeros_like(tot[0])

    def factor(self, a, b, exact):
        """Key factor F_ab [BC(j), K] of key sub-tile b for query sub-tile a (b <= a); None for the
        diagonal tile of the exact path (formed elementwise instead)."""
        if b < a:
            return self.ekl[b] * jnp.exp(self.ssum(b + 1, a))
        return None if exact else jnp.exp(-self.ch.Gs[a])


def _tri_masks(BC):
    r, c = iota((BC, BC), 0), iota((BC, BC), 1)
    return r >= c, r > c


def _mask(ch, a, b, strict):
    """Bool [BC, BC] mask of tile (a, b): causal (inclusive or strict) on the diagonal, same segment."""
    BC = ch.BC
    incl, strc = _tri_masks(BC)
    m = None if a > b else (strc if strict else incl)
    if ch.seg is not None:
        same = ch.seg.cnt[a] == row(ch.seg.cnt[b])  # [BC, 1] vs [1, BC]
        m = same if m is None else (m & same)
    return m


def _apply(mask, x):
    return x if mask is None else jnp.where(mask, x, 0.0)


def _seg_vecs(ch):
    """``(reads_state, in_last, no_reset)`` per sub-tile ([BC, 1] lists, [1, 1]); None without segments."""
    if ch.seg is None:
        return [None] * ch.NC, [None] * ch.NC, None
    return ch.seg.reads_state, ch.seg.in_last, ch.seg.no_reset


def _times(x, m):
    return x if m is None else x * m


def exact_pair_sum(lhs_p, k_p, Gs_p):
    """``sum_d lhs_id k_jd exp(min(Gs_id - Gs_jd, 0))`` for one column piece: [BC, KP] x3 -> [BC, BC]."""
    e = jnp.exp(jnp.minimum(Gs_p[:, None, :] - Gs_p[None, :, :], 0.0))  # [i, j, KP]
    return jnp.sum(lhs_p[:, None, :] * k_p[None, :, :] * e, axis=-1)


def scores(ch, gt, exact, mmdt):
    """Lower tiles of ``A_qk`` and ``A_kk`` (before masking): ``{(a, b): [BC, BC]}`` fp32, from the operands
    ``q_a exp(Gs_a)`` / ``kb_a exp(Gs_a)`` and ``k_b F_ab`` (exact diagonal tiles: per-pair exponents)."""
    A_qk, A_kk = {}, {}
    for a in range(ch.NC):
        xq_m, xk_m = (ch.q[a] * gt.eq[a]).astype(mmdt), (ch.kb[a] * gt.eq[a]).astype(mmdt)
        for b in range(a + 1):
            F = gt.factor(a, b, exact)
            if F is None:
                A_qk[a, b] = _sum([exact_pair_sum(q, k, g) for q, k, _, g in ch.pieces[a]])
                A_kk[a, b] = _sum([exact_pair_sum(kb, k, g) for _, k, kb, g in ch.pieces[a]])
            else:
                KF = (ch.k[b] * F).astype(mmdt)
                A_qk[a, b] = mm(xq_m, KF, trans_b=True)
                A_kk[a, b] = mm(xk_m, KF, trans_b=True)
    return A_qk, A_kk


def block_unit_lower_inverse(L, NC, BC, precision):
    """``(I + L)^-1`` of a strictly lower-triangular [C, C] matrix given as lower tiles ``L[(a, b)]``.

    Diagonal tiles ``D_a = (I + L_aa)^-1`` by doubling (``_math.unit_lower_inverse``), then block forward
    substitution ``X_ab = -D_a sum_{c=b}^{a-1} L_ac X_cb``; returns the lower tiles ``{(a, b): [BC, BC]}``.
    """
    mm_ = lambda x, y: mm(x, y, precision=precision)
    X = {}
    for a in range(NC):
        X[a, a] = unit_lower_inverse(L[a, a], BC, BC, precision)
        for b in range(a):
            X[a, b] = -mm_(X[a, a], _sum([mm_(L[a, c], X[c, b]) for c in range(b, a)]))
    return X


@dataclasses.dataclass
class WY:
    """The WY factors of one chunk (fp32; NC x [BC, K] unless noted): Wr = ``exp(G) kb`` (times
    reads_state), Qg = ``q exp(G)`` (times reads_state), k_out = ``k exp(G_last - G)`` (times in_last),
    decay = ``exp(G_last)`` [1, K] (times no_reset): ``W = Inv Wr`` reads the state (``delta = U - W S``),
    ``o = Qg S + A_qk delta``, ``S' = Diag(decay) S + k_out^T delta``. rs, il: reads_state / in_last
    (None without segments)."""

    Wr: list
    Qg: list
    k_out: list
    decay: object
    rs: list
    il: list


def wy_factors(ch: Chunk, gt: Gate) -> WY:
    rs, il, no_reset = _seg_vecs(ch)
    return WY(Wr=[_times(gt.eG[b] * ch.kb[b], rs[b]) for b in range(ch.NC)],
              Qg=[_times(ch.q[a] * gt.eG[a], rs[a]) for a in range(ch.NC)],
              k_out=[_times(ch.k[b] * gt.k_end[b], il[b]) for b in range(ch.NC)],
              decay=_times(jnp.exp(gt.G_last), no_reset), rs=rs, il=il)


@dataclasses.dataclass
class Intra:
    """The chunk-local (state-independent) quantities of one chunk: A_qk, the masked output scores (lower
    ``[BC, BC]`` tiles); inv / inv_m, ``(I + L)^-1`` (fp32 / mmdt tiles); W = ``Inv Wr`` (NC x [BC, K]);
    wy, the ``WY`` factors."""

    A_qk: dict
    inv: dict
    inv_m: dict
    W: list
    wy: WY


def intra(ch: Chunk, *, exact, mmdt) -> Intra:
    """Scores, triangular inverse and WY weights of one chunk: no state involved, so every chunk of every
    head is independent (the chunk-parallel kernels)."""
    gt = Gate(ch)
    A_qk, A_kk = scores(ch, gt, exact, mmdt)
    A_qk = {ab: _apply(_mask(ch, *ab, strict=False), t) for ab, t in A_qk.items()}
    L = {ab: _apply(_mask(ch, *ab, strict=True), t) for ab, t in A_kk.items()}
    inv = block_unit_lower_inverse(L, ch.NC, ch.BC, inv_precision(mmdt))
    inv_m = {ab: t.astype(mmdt) for ab, t in inv.items()}
    wy = wy_factors(ch, gt)
    Wr_m = [w.astype(mmdt) for w in wy.Wr]
    W = [_sum([mm(inv_m[a, b], Wr_m[b]) for b in range(a + 1)]) for a in range(ch.NC)]
    return Intra(A_qk=A_qk, inv=inv, inv_m=inv_m, W=W, wy=wy)


def wy_values(f: Intra, vb):
    """``U = Inv vb``: NC x [BC, V] fp32 from vb = beta v (NC x [BC, V] in mmdt); ``delta = U - W S``."""
    return [_sum([mm(f.inv_m[a, b], vb[b]) for b in range(a + 1)]) for a in range(len(vb))]


@dataclasses.dataclass
class VSums:
    """The backward's sums over V (accumulated V block by V block): dk_out, dQg, dW (NC x [BC, K]), the
    tiles dA_qk (unmasked) and dInv_v (the ``ddelta vb^T`` part of dInv), and ``sum_v S dS'`` [1, K]."""

    dk_out: list
    dQg: list
    dW: list
    dA_qk: dict
    dInv: dict
    dG_last: object

    @classmethod
    def zeros(cls, NC, BC, K):
        z = lambda shape: jnp.zeros(shape, F32)
        tiles = lambda: {(a, b): z((BC, BC)) for a in range(NC) for b in range(a + 1)}
        return cls(dk_out=[z((BC, K))] * NC, dQg=[z((BC, K))] * NC, dW=[z((BC, K))] * NC, dA_qk=tiles(),
                   dInv=tiles(), dG_last=z((1, K)))


def v_block_backward(f: Intra, sums: VSums, *, vb, delta, ddelta, dO, S, dSp, mmdt):
    """One V block of the backward's state-dependent products; returns ``(dvb, sums)``.

    vb, delta (mmdt), ddelta (fp32), dO: NC x [BC, BV] of this V block; S: the state entering the chunk and
    dSp the cotangent of the state leaving it, [K, BV] in mmdt (as stored by the recurrence kernels); ddelta
    the pseudo-values' cotangent ``A_qk^T dO + k_out dS'`` from the backward recurrence. dvb = ``Inv^T
    ddelta`` (NC x [BC, BV] fp32) is complete for the block; everything else is summed over blocks.
    """
    NC = len(delta)
    prec = inv_precision(mmdt)
    S_m, dSp_m = S.astype(mmdt), dSp.astype(mmdt)
    delta_m = [d.astype(mmdt) for d in delta]
    ddelta_m = [d.astype(mmdt) for d in ddelta]
    dO_m = [d.astype(mmdt) for d in dO]
    vb32 = [v.astype(F32) for v in vb]
    # S' = Diag(decay) S + k_out^T delta;  o = Qg S + A_qk delta;  delta = U - W S;  U = Inv vb
    sums = VSums(
        dk_out=[sums.dk_out[b] + mm(delta_m[b], dSp_m, trans_b=True) for b in range(NC)],
        dQg=[sums.dQg[a] + mm(dO_m[a], S_m, trans_b=True) for a in range(NC)],
        dW=[sums.dW[a] - mm(ddelta_m[a], S_m, trans_b=True) for a in range(NC)],
        dA_qk={(a, b): t + mm(dO_m[a], delta_m[b], trans_b=True) for (a, b), t in sums.dA_qk.items()},
        dInv={(p, q): t + mm(ddelta[p], vb32[q], trans_b=True, precision=prec) for (p, q), t in sums.dInv.items()},
        dG_last=sums.dG_last + jnp.sum(S.astype(F32) * dSp.astype(F32), axis=1).reshape(1, S.shape[0]),
    )
    dvb = [_sum([mm(f.inv_m[a, b], ddelta_m[a], trans_a=True) for a in range(b, NC)]) for b in range(NC)]
    return dvb, sums


def intra_backward(ch: Chunk, inv, sums: VSums, *, exact, mmdt):
    """The K side of one chunk's backward, from the V sums and the inverse's fp32 tiles ``inv``: returns
    ``(dq, dk, dkb, dGs)``, NC x [BC, K] fp32 each (dq with respect to the *scaled* q, dGs to the sub-tile
    cumsum); see ``_math.chunk_backward`` for the derivation.

    The gate factors and score operands are rebuilt here from ``ch`` rather than kept from ``intra``: a GPU
    kernel passes a chunk loaded afresh after its V loop, so that the ``[BC, K]`` operands do not stay alive
    (in registers and in the shared-memory buffers of their products) across the whole kernel. Keeping
    them made the fp32 backward ask for 250 KiB of shared memory (the limit is 227)."""
    NC, BC = ch.NC, ch.BC
    gt = Gate(ch)
    wy = wy_factors(ch, gt)
    Wr, Qg, k_out, rs, il = wy.Wr, wy.Qg, wy.k_out, wy.rs, wy.il
    inv_m = {ab: t.astype(mmdt) for ab, t in inv.items()}
    prec = inv_precision(mmdt)
    dk_out, dQg, dW = sums.dk_out, sums.dQg, sums.dW
    dA_qk = {ab: _apply(_mask(ch, *ab, strict=False), t) for ab, t in sums.dA_qk.items()}
    # ---- W = Inv Wr, Inv = (I + L)^-1
    dW_m = [d.astype(mmdt) for d in dW]
    dWr = [_sum([mm(inv_m[a, b], dW_m[a], trans_a=True) for a in range(b, NC)]) for b in range(NC)]
    dInv = {(p, q): t + mm(dW[p], Wr[q], trans_b=True, precision=prec) for (p, q), t in sums.dInv.items()}
    # dL = -(Inv^T dInv Inv^T) on the strictly lower part: X = Inv^T dInv, then dL = -X Inv^T
    X = {(i, q): _sum([mm(inv[p, i], dInv[p, q], trans_a=True, precision=prec) for p in range(i, NC)])
         for i in range(NC) for q in range(i + 1)}
    dL = {(i, j): _apply(_mask(ch, i, j, strict=True),
                         -_sum([mm(X[i, q], inv[j, q], trans_b=True, precision=prec) for q in range(j + 1)]))
          for i in range(NC) for j in range(i + 1)}
    # ---- elementwise factors
    dq = [_times(dQg[a] * gt.eG[a], rs[a]) for a in range(NC)]
    dkb = [_times(dWr[a] * gt.eG[a], rs[a]) for a in range(NC)]
    dk = [_times(dk_out[a] * gt.k_end[a], il[a]) for a in range(NC)]
    dG = [dWr[a] * Wr[a] + dQg[a] * Qg[a] - dk_out[a] * k_out[a] for a in range(NC)]
    dG_last = sums.dG_last * wy.decay + _sum([colsum(dk_out[a] * k_out[a]) for a in range(NC)])
    # ---- scores: A[i, j] = sum_d x_id k_jd exp(G_id - G_jd) -> dx, dk and dG = x dx - k dk
    dxq, dxk, dks = [], [], [jnp.zeros_like(t) for t in ch.k]
    dAq_m = {ab: t.astype(mmdt) for ab, t in dA_qk.items()}
    dL_m = {ab: t.astype(mmdt) for ab, t in dL.items()}
    for a in range(NC):  # the operands are formed where they are used: short live ranges (see above)
        xq_m, xk_m = (ch.q[a] * gt.eq[a]).astype(mmdt), (ch.kb[a] * gt.eq[a]).astype(mmdt)
        terms_q, terms_k = [], []
        for b in range(a + 1 - int(exact)):  # anchored tiles: A = (q exp(Gs_i)) (k F)^T
            KF = (ch.k[b] * gt.factor(a, b, exact)).astype(mmdt)
            terms_q.append(mm(dAq_m[a, b], KF))
            terms_k.append(mm(dL_m[a, b], KF))
            dKF = mm(dAq_m[a, b], xq_m, trans_a=True) + mm(dL_m[a, b], xk_m, trans_a=True)  # [BC(j), K]
            dks[b] = dks[b] + dKF * gt.factor(a, b, exact)
        zero = jnp.zeros_like(ch.q[a])
        dxq.append(gt.eq[a] * _sum(terms_q) if terms_q else zero)
        dxk.append(gt.eq[a] * _sum(terms_k) if terms_k else zero)
        if exact:  # the diagonal tile with exact per-pair exponents (no exp(Gs_i) factor)
            eq_d, ek_d, dk_d = _exact_diag_bwd(ch.pieces[a], dA_qk[a, a], dL[a, a], ch.k[a].shape[1])
            dxq[a], dxk[a], dks[a] = dxq[a] + eq_d, dxk[a] + ek_d, dks[a] + dk_d
    for a in range(NC):
        dq[a] = dq[a] + dxq[a]
        dkb[a] = dkb[a] + dxk[a]
        dk[a] = dk[a] + dks[a]
        dG[a] = dG[a] + ch.q[a] * dxq[a] + ch.kb[a] * dxk[a] - ch.k[a] * dks[a]
    # ---- G -> Gs: G_i = Gs_i + sum_{s < sub-tile(i)} tot_s, G_last = sum_s tot_s = G of the last row
    last_row = iota((BC, 1), 0) == BC - 1
    dG[NC - 1] = dG[NC - 1] + jnp.where(last_row, dG_last, 0.0)
    col_sums = [colsum(d) for d in dG]
    dGs = [dG[a] + (jnp.where(last_row, _sum(col_sums[a + 1:]), 0.0) if a < NC - 1 else 0.0) for a in range(NC)]
    return dq, dk, dkb, dGs


def _exact_diag_bwd(pieces, tq, tk, K):
    """Backward of the exact diagonal tile: given the fp32 tile cotangents tq = dA_qk_aa, tk = dL_aa
    [BC, BC], returns ``(dxq, dxk, dk)`` [BC, K]: the q-side and kb-side sums ``sum_j t_ij E_ijd k_jd`` and
    the key side ``sum_i (tq_ij q_id + tk_ij kb_id) E_ijd``, E = exp(min(Gs_i - Gs_j, 0)). Column pieces
    are placed into K columns with exact 0/1 matmuls (no lane concatenation on Triton)."""
    outs = [[], [], []]
    KP = pieces[0][0].shape[1]
    for p, (q, k, kb, g) in enumerate(pieces):
        E = jnp.exp(jnp.minimum(g[:, None, :] - g[None, :, :], 0.0))  # [i, j, KP]
        eq3, ek3 = tq[:, :, None] * E, tk[:, :, None] * E
        parts = (jnp.sum(eq3 * k[None, :, :], axis=1), jnp.sum(ek3 * k[None, :, :], axis=1),
                 jnp.sum(eq3 * q[:, None, :] + ek3 * kb[:, None, :], axis=0))
        if len(pieces) > 1:
            place = (iota((KP, K), 1) == iota((KP, K), 0) + p * KP).astype(F32)  # [KP, K]
            parts = tuple(mm(x, place, precision=HIGHEST) for x in parts)
        for o, x in zip(outs, parts):
            o.append(x)
    return tuple(_sum(o) for o in outs)
