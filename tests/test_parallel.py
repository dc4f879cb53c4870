"""The whole model on 8 fake CPU devices: logits, gradients and Quantile Balancing statistics with expert
and sequence parallelism (each alone, and both with data parallelism combined) equal the single-device
result, and a training step with all three matches one device (float32).

A 4-layer tiny K3 (two scanned [KDA, MLA] groups, every FFN a latent MoE, Block AttnRes) on packed rows
whose documents cross the sequence shards. Each check runs in a subprocess
(``tests/children/whole_model_parallel.py``): the device count must be set before JAX starts, and the rest of
the suite runs on one device.
"""

import pytest

from cpu_devices import run_child


@pytest.mark.slow
def test_forward_and_gradients_match_single_device_on_every_axis():
    print(run_child("whole_model_parallel", "forward"))


@pytest.mark.slow
def test_train_step_with_data_expert_sequence_parallelism_matches_one_device():
    print(run_child("whole_model_parallel", "train_step", timeout=1200))
