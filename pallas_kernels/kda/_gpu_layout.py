"""What the GPU chunk-KDA kernels share: their static configuration, the tile sizes per dtype, the layout
of the arrays between kernels, and the load of one chunk's sub-tiles (``_tiles.Chunk``).

Layout. Token arrays are ``[B, Tp, H * width]`` (``Tp`` = T padded to whole chunks; the inputs' free
``[B, T, H, K]`` view), read and written per head as ``[rows, width]`` column blocks; per-chunk states are
``[B, H, N * K, V]`` (the state entering chunk n in rows ``n*K .. n*K + K``, as fla's ``h``); the
per-chunk decays ``[B, H, N, K]``; the output scores ``A_qk`` ``[B, Tp, H * C]`` (row i of a chunk, column
j of the same chunk; zeros above the diagonal).
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import _tiles
from pallas_kernels.kda._paths import BC

F32 = jnp.float32
MIN_DOT = 16  # tl.dot needs every block dim >= 16
EXACT_PIECE = 32  # K columns per piece of an exact diagonal tile: [16, 16, 32] fp32 = 8192 values
SEG_COLS = 3  # packed segment vectors per token: reset count, reads_state, in_last

# Tile sizes per matmul dtype (untuned: no GPU has compiled these kernels yet). ``block_v``: the V block
# of the recurrence and output kernels, and the V step of the intra backward; ``loop_stages``: Triton's
# software-pipelining depth of the two recurrence loops (each buffered stage holds a chunk's loads in
# shared memory: docs/kernels.md has the arithmetic per kernel); ``warps`` per kernel kind.
TILING = {
    jnp.dtype(jnp.bfloat16): dict(block_v=64, loop_stages=2),
    jnp.dtype(jnp.float16): dict(block_v=64, loop_stages=2),
    jnp.dtype(F32): dict(block_v=32, loop_stages=1),
}
WARPS = dict(intra=4, state=4, output=4)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    scale: float
    C: int  # chunk: a power of two >= 16 (whole-chunk [C, *] blocks in the recurrence and output kernels)
    K: int  # padded key dim (power of two >= 16)
    V: int  # padded value dim
    BV: int  # V block of the recurrence and output kernels, the V step of the intra backward
    exact: bool | None  # None = decide at run time from the gate
    interpret: object
    out_dtype: object
    mmdt: object  # matmul operand dtype; also the dtype of the states, A_qk, W, k_out, Qg and delta in HBM
    loop_stages: int
    warps: tuple  # ((kernel kind, num_warps), ...)

    @property
    def NV(self):
        return self.V // self.BV

    @property
    def NC(self):
        return self.C // BC

    def num_warps(self, kind):
        return dict(self.warps)[kind]


def tiling(mmdt, *, block_v=None, num_warps=None, num_stages=None):
    """``(block_v, loop_stages, warps)`` for a matmul dtype, with the caller's overrides."""
    t = TILING[jnp.dtype(mmdt)]
    warps = WARPS if num_warps is None else {kind: num_warps for kind in WARPS}
    return (t["block_v"] if block_v is None else block_v, t["loop_stages"] if num_stages is None else num_stages,
            tuple(sorted(warps.items())))


def head_cols(rows, width, index):
    """BlockSpec of one head's ``[rows, width]`` block of a ``[B, Tp, H * width']`` array; ``index`` maps the
    grid ids to (batch, row block, column block)."""
    return pl.BlockSpec((pl.Squeezed(), rows, width), index)


def tile_rows(a):
    """Rows of sub-tile a inside a one-chunk block."""
    return pl.ds(a * BC, BC)


def load_chunk(q_ref, k_ref, kb_ref, vb_ref, gs_ref, seg_ref, cfg, exact):
    """One-chunk blocks (``[C, *]`` refs) -> ``_tiles.Chunk`` of NC sub-tiles (vb_ref may be None)."""
    NC = cfg.NC
    rows = lambda ref, a: ref[tile_rows(a), :]
    q = [rows(q_ref, a).astype(F32) * cfg.scale for a in range(NC)]
    k = [rows(k_ref, a).astype(F32) for a in range(NC)]
    kb = [rows(kb_ref, a).astype(F32) for a in range(NC)]
    vb = None if vb_ref is None else [rows(vb_ref, a) for a in range(NC)]
    Gs = [rows(gs_ref, a) for a in range(NC)]
    tot = [gs_ref[pl.ds(a * BC + BC - 1, 1), :] for a in range(NC)]  # [1, K]
    seg = None
    if seg_ref is not None:
        column = lambda a, c: seg_ref[tile_rows(a), pl.ds(c, 1)]  # [BC, 1]
        seg = _tiles.Segments(
            cnt=[column(a, 0) for a in range(NC)],
            reads_state=[column(a, 1) for a in range(NC)],
            in_last=[column(a, 2) for a in range(NC)],
            no_reset=seg_ref[pl.ds(cfg.C - 1, 1), pl.ds(1, 1)],  # [1, 1]
        )
    pieces = None
    if exact:
        KP = min(EXACT_PIECE, cfg.K)
        piece = lambda ref, a, p: ref[tile_rows(a), pl.ds(p * KP, KP)]
        pieces = [[(piece(q_ref, a, p).astype(F32) * cfg.scale, piece(k_ref, a, p).astype(F32),
                    piece(kb_ref, a, p).astype(F32), piece(gs_ref, a, p)) for p in range(cfg.K // KP)]
                  for a in range(NC)]
    return _tiles.Chunk(q=q, k=k, kb=kb, vb=vb, Gs=Gs, tot=tot, seg=seg, pieces=pieces)
