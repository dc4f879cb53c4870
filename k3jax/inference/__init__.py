"""Generation in one jitted program (``generate``: ``k3jax.generate``) and the token samplers (``sampling``;
the server's per-row sampler, ``k3jax.serving.sampling``, uses its nucleus rule)."""
