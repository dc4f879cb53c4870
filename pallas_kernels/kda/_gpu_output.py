"""The GPU output kernel of chunk KDA (``kda_output_gpu``): ``o = Qg S + A_qk delta`` per chunk, from the
state entering the chunk (stored by the recurrence) and the pseudo-values. Grid ``(B, H, N chunks, V / BV)``,
fully parallel: two ``[C, *]`` matmuls per program."""

from jax.experimental import pallas as pl

from pallas_kernels._common import mm, triton_params
from pallas_kernels.kda._gpu_layout import head_cols
from pallas_kernels.varying import out_struct

OUTPUT = "output"


def _kernel(qg_ref, hs_ref, A_ref, delta_ref, o_ref):
    o_ref[...] = (mm(qg_ref[...], hs_ref[...]) + mm(A_ref[...], delta_ref[...])).astype(o_ref.dtype)


def output(Qg, hs, A, delta, *, cfg, B, H, N):
    """Qg ``[B, Tp, H*K]``, hs ``[B, H, N*K, V]``, A ``[B, Tp, H*C]``, delta ``[B, Tp, H*V]`` (all mmdt) ->
    o ``[B, Tp, H*V]`` in the output dtype."""
    C, K, V, BV, NV = cfg.C, cfg.K, cfg.V, cfg.BV, cfg.NV
    return pl.pallas_call(
        _kernel,
        out_shape=out_struct((B, N * C, H * V), cfg.out_dtype, Qg),
        grid=(B, H, N, NV),
        in_specs=[head_cols(C, K, lambda b, h, n, v: (b, n, h)),
                  pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, BV), lambda b, h, n, v: (b, h, n, v)),
                  head_cols(C, C, lambda b, h, n, v: (b, n, h)),
                  head_cols(C, BV, lambda b, h, n, v: (b, n, h * NV + v))],
        out_specs=head_cols(C, BV, lambda b, h, n, v: (b, n, h * NV + v)),
        compiler_params=triton_params(cfg.num_warps(OUTPUT), 1),
        interpret=cfg.interpret,
        name="kda_output_gpu",
    )(Qg, hs, A, delta)
