"""Pallas kernels (TPU Mosaic; interpret mode on CPU) for chunkwise KDA and the latent MoE experts.

- ``pallas_kernels.kda.chunk_kda``: drop-in for ``k3jax.ops.chunk_kda`` (config ``kda_impl: pallas``),
  forward and backward kernels.
- ``pallas_kernels.moe.grouped_glu_experts``: drop-in for ``k3jax.ops.moe.grouped_glu_experts``
  (config ``moe_impl: pallas``), built on the grouped matmul ``gmm`` / ``tgmm`` / ``grouped_matmul``.

Every entry point takes ``interpret`` (None = interpret unless the default device is a TPU or GPU)
and ``backend`` (``"tpu"``; ``"gpu"`` is not implemented yet and raises). The pure-JAX ops in
``k3jax.ops`` are the references (tests/test_pallas_*.py); tests/test_pallas_tpu_aot.py compiles
every kernel for v5p and v6e with libtpu; bench/kernels.py measures them.
"""
