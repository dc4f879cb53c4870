"""Pallas kernels for chunkwise KDA and the latent MoE experts: TPU (Mosaic) and GPU (Triton); interpret
mode on CPU. docs/kernels.md describes them.

- ``pallas_kernels.kda.chunk_kda``: drop-in for ``k3jax.ops.chunk_kda`` (config ``kda_impl: pallas``),
  forward and backward kernels.
- ``pallas_kernels.moe.grouped_glu_experts``: drop-in for ``k3jax.ops.moe.grouped_glu_experts``
  (config ``moe_impl: pallas``), built on the grouped matmul ``gmm`` / ``tgmm`` / ``grouped_matmul``; on TPU
  MXFP4 weights (``pallas_kernels.mxfp4.MXFP4``) go to ``gmm_mxfp4``, which decodes them tile by tile.

Every entry point takes ``interpret`` (None = interpret unless the target platform, i.e. the current
mesh's or else the default device's, is a TPU or GPU) and ``backend`` (``"tpu"``, ``"gpu"`` or None = the
target platform's; TPU on a CPU host). The pure-JAX ops in ``k3jax.ops`` are the references
(tests/test_pallas_*.py); tests/test_pallas_tpu_aot.py compiles every TPU kernel for v5p and v6e with
libtpu, tests/test_pallas_gpu.py lowers every GPU kernel to Triton IR for CUDA; bench/kernels.py measures
them.
"""
