"""``backward="xla"`` of the chunk kernels (TPU ``chunk.py``, GPU ``chunk_gpu.py``): the kernel forward
paired with the VJP of the pure-JAX reference, ``k3jax.ops.kda.chunk_kda``."""

import functools

import jax

from k3jax.ops import kda as ref_kda


def _reference(q, k, v, g, beta, h0, segment_ids, cfg):
    return ref_kda.chunk_kda(q, k, v, g, beta, scale=cfg.scale, initial_state=h0, output_final_state=True,
                             chunk_size=cfg.C, segment_ids=segment_ids)


def with_reference_backward(forward):
    """``forward(q, k, v, g, beta, h0, segment_ids, cfg) -> (o, final_state)`` (``cfg`` static, with
    ``scale`` and the chunk ``C``), its backward pass the reference's own autodiff."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def run(q, k, v, g, beta, h0, segment_ids, cfg):
        return forward(q, k, v, g, beta, h0, segment_ids, cfg)

    def run_fwd(q, k, v, g, beta, h0, segment_ids, cfg):
        return forward(q, k, v, g, beta, h0, segment_ids, cfg), (q, k, v, g, beta, h0, segment_ids)

    def run_bwd(cfg, res, cts):
        q, k, v, g, beta, h0, segment_ids = res
        _, vjp = jax.vjp(lambda *a: _reference(*a, segment_ids, cfg), q, k, v, g, beta, h0)
        return (*vjp(cts), None)

    run.defvjp(run_fwd, run_bwd)
    return run
