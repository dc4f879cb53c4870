"""A prefill chunk whose time axis is split over devices (issue 31): KDA continues a cache through the
sequence-parallel state fold and short conv (k3jax/parallel/sequence.py) seeded with the cached state and
conv window, instead of GSPMD partitioning the chunkwise scan over the split axis.

On 8 fake CPU devices (tests/children/cached_prefill_parallel.py, a subprocess: the device count is set
before JAX starts):

- the ops: ``sequence.chunk_kda`` / ``sequence.causal_conv1d`` with an initial state equal
  ``k3jax.ops.kda.chunk_kda`` / ``k3jax.ops.conv.causal_conv1d`` with it (outputs, final states and
  gradients), with and without packed documents, on meshes that split the time axis 8 and 4 ways;
- a KDA layer's cached chunk compiles to collectives of the fold's size (the per-shard maps, the halos
  and the final states), where the GSPMD-partitioned scan moves the chunk's activations;
- a small hybrid model prefills ragged, left-padded prompts in several chunks (split 8 ways, 4 ways, at
  the shortest shard the conv allows, and a chunk that does not split) and then decodes, with the
  single-device logits and cache, batch 1 and 2.
"""

import pytest

from cpu_devices import run_child


@pytest.mark.slow
def test_cached_prefill_chunk_over_split_time_axis_on_8_devices():
    print(run_child("cached_prefill_parallel"))
