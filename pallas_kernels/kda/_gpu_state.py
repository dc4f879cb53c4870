"""The GPU recurrence kernels of chunk KDA: the only sequential work. Grid ``(B, H, V / BV)``; each
program walks the chunks in an in-kernel ``lax.fori_loop`` carrying one fp32 state block ``[K, BV]`` (or
its cotangent) in registers. Per chunk they do three ``[C, K] x [K, BV]``-sized matmuls on operands the
chunk-parallel kernel (``_gpu_intra``) prepared, nothing else.

- ``state_forward`` (``kda_state_fwd_gpu``): stores the state entering chunk n, ``delta = U - W S``
  (the pseudo-values) and steps ``S <- Diag(decay) S + k_out^T delta``; returns the final state.
- ``state_backward`` (``kda_state_bwd_gpu``): chunks last to first, carrying ``dS`` (the cotangent of the
  state leaving the chunk): stores it, ``ddelta = A_qk^T dO + k_out dS`` and steps
  ``dS <- Diag(decay) dS + Qg^T dO - W^T ddelta``; returns the initial state's cotangent.
"""

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels._common import mm, triton_params
from pallas_kernels.kda._gpu_layout import F32, head_cols
from pallas_kernels.kda._tiles import col
from pallas_kernels.varying import out_struct

STATE = "state"


def _decay(decay_ref, n):
    """[K, 1] decay of the state over chunk n."""
    return col(decay_ref[pl.ds(n, 1), :])


def _specs(cfg, N):
    """(token block of width K, of width BV, the per-chunk decays, a [K, BV] state, the states of all
    chunks) for grid (b, h, v)."""
    Tp, K, BV, NV = N * cfg.C, cfg.K, cfg.BV, cfg.NV
    return (head_cols(Tp, K, lambda b, h, v: (b, 0, h)),
            head_cols(Tp, BV, lambda b, h, v: (b, 0, h * NV + v)),
            pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), N, K), lambda b, h, v: (b, h, 0, 0)),
            pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, BV), lambda b, h, v: (b, h, 0, v)),
            pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), N * K, BV), lambda b, h, v: (b, h, 0, v)))


def _fwd_kernel(*refs, cfg, N, has_h0):
    it = iter(refs)
    w_ref, u_ref, kout_ref, decay_ref = (next(it) for _ in range(4))
    h0_ref = next(it) if has_h0 else None
    hs_ref, delta_ref, hT_ref = next(it), next(it), next(it)
    C, K, mmdt = cfg.C, cfg.K, cfg.mmdt

    def body(n, S):
        hs_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = S.astype(hs_ref.dtype)
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        delta = u_ref[rows, :] - mm(w_ref[rows, :], S.astype(mmdt))  # [C, BV]
        delta_m = delta.astype(mmdt)
        delta_ref[rows, :] = delta_m.astype(delta_ref.dtype)
        return S * _decay(decay_ref, n) + mm(kout_ref[rows, :], delta_m, trans_a=True)

    S0 = h0_ref[...] if has_h0 else jax.numpy.zeros((K, cfg.BV), F32)
    hT_ref[...] = jax.lax.fori_loop(0, N, body, S0)


def state_forward(W, U, k_out, decay, h0, *, cfg, B, H, N):
    """-> ``(hs [B, H, N*K, V] in mmdt: the state entering every chunk, delta [B, Tp, H*V] in mmdt,
    final state [B, H, K, V] fp32)``."""
    Tp, K, V = N * cfg.C, cfg.K, cfg.V
    tok_k, tok_v, decay_spec, state, states = _specs(cfg, N)
    has_h0 = h0 is not None
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, N=N, has_h0=has_h0),
        out_shape=[out_struct((B, H, N * K, V), cfg.mmdt, W), out_struct((B, Tp, H * V), cfg.mmdt, W),
                   out_struct((B, H, K, V), F32, W)],
        grid=(B, H, cfg.NV),
        in_specs=[tok_k, tok_v, tok_k, decay_spec] + ([state] if has_h0 else []),
        out_specs=[states, tok_v, state],
        compiler_params=triton_params(cfg.num_warps(STATE), cfg.loop_stages),
        interpret=cfg.interpret,
        name="kda_state_fwd_gpu",
    )(W, U, k_out, decay, *([h0] if has_h0 else []))


def _bwd_kernel(A_ref, do_ref, kout_ref, qg_ref, w_ref, decay_ref, dhT_ref, dhs_ref, ddelta_ref, dh0_ref, *, cfg,
                N):
    C, K, mmdt = cfg.C, cfg.K, cfg.mmdt

    def body(i, dS):
        n = N - 1 - i  # chunks last to first
        dhs_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = dS.astype(dhs_ref.dtype)
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        dO = do_ref[rows, :].astype(mmdt)  # [C, BV]
        ddelta = mm(kout_ref[rows, :], dS.astype(mmdt)) + mm(A_ref[rows, :], dO, trans_a=True)  # [C, BV]
        ddelta_ref[rows, :] = ddelta
        return (dS * _decay(decay_ref, n) + mm(qg_ref[rows, :], dO, trans_a=True)
                - mm(w_ref[rows, :], ddelta.astype(mmdt), trans_a=True))

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])


def state_backward(A, do, k_out, Qg, W, decay, dhT, *, cfg, B, H, N):
    """-> ``(dhs [B, H, N*K, V] in mmdt: the cotangent of the state leaving every chunk, ddelta
    [B, Tp, H*V] fp32, d initial state [B, H, K, V] fp32)``. A: the output scores ``[B, Tp, H*C]``."""
    Tp, C, K, V = N * cfg.C, cfg.C, cfg.K, cfg.V
    tok_k, tok_v, decay_spec, state, states = _specs(cfg, N)
    scores = head_cols(Tp, C, lambda b, h, v: (b, 0, h))
    return pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg, N=N),
        out_shape=[out_struct((B, H, N * K, V), cfg.mmdt, W), out_struct((B, Tp, H * V), F32, W),
                   out_struct((B, H, K, V), F32, W)],
        grid=(B, H, cfg.NV),
        in_specs=[scores, tok_v, tok_k, tok_k, tok_k, decay_spec, state],
        out_specs=[states, tok_v, state],
        compiler_params=triton_params(cfg.num_warps(STATE), cfg.loop_stages),
        interpret=cfg.interpret,
        name="kda_state_bwd_gpu",
    )(A, do, k_out, Qg, W, decay, dhT)
