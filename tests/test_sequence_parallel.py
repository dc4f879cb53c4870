"""Sequence parallelism (k3jax/parallel/sequence.py) on 8 fake CPU devices: the short conv, chunkwise
KDA and the MLA layer with the time axis split over ``sequence`` (and over the data-like axes the batch
leaves free) equal their single-device results, forward and backward, with packed documents that start
inside shards and exactly at shard boundaries.

The 8-device checks run in a subprocess (``tests/children/sequence_parallel_ops.py``): the device count must
be set before JAX starts, and the rest of the suite runs on one device.
"""

import pytest

from cpu_devices import run_child

@pytest.mark.slow
def test_sequence_parallel_ops_match_single_device():
    print(run_child("sequence_parallel_ops"))
