"""Pallas kernels (TPU Mosaic / GPU) for chunkwise KDA and the latent MoE dispatch.

Empty until the kernels issue: the pure-JAX ops in ``k3jax.ops`` are the references they will be
tested against and are what every config uses today (``kda_impl: xla``, ``moe_impl: ragged_dot``).
"""
