"""Explicit parallelism inside the model: ``jax.shard_map`` code that GSPMD alone would not produce.

- ``expert``: expert parallelism for the routed experts (token exchange over the ``expert`` axis).
- ``sequence``: sequence (context) parallelism for KDA, its short conv and MLA over ``sequence``.

Their PartitionSpecs and collective axes come from the rule table of ``k3jax.sharding`` (the one that
lays out parameters and activations for GSPMD; ``axis_rules`` swaps it for both), not from axis names
written here, and the mesh they run under from its ``current_mesh``. Without a mesh (or with every axis of size 1) none of this runs and the layers take their
single-device path.
"""
