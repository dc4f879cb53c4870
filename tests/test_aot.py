"""The AOT scale proof at test size: compile the real train and decode steps of the ``small`` config
for a v5p slice with libtpu (no TPU needed) and check what ``python -m k3jax.aot`` reports for full K3.

Needs ``jax[tpu]==0.10.2`` (libtpu); skipped otherwise. Run with ``pytest -m tpu_aot tests/test_aot.py``.
"""

import math
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load libtpu at once
pytest.importorskip("libtpu")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import aot  # noqa: E402
from k3jax.config import MeshConfig  # noqa: E402
from k3jax.params import count_params  # noqa: E402

pytestmark = pytest.mark.tpu_aot

SLICE = "v5p-8"  # 2x2x1 chips: 4 devices
MESH = MeshConfig(data=1, fsdp=2, expert=2)
TRAIN = aot.Job("small", "train", SLICE, MESH, batch=8, seq_len=256)
DECODE = aot.Job("small", "decode", SLICE, MESH, batch=1, seq_len=4096)


def _devices():
    try:
        return aot.TpuSlice.v5p(SLICE).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")


@pytest.fixture(scope="module")
def train_result():
    return aot.compile_job(TRAIN, devices=_devices())


@pytest.fixture(scope="module")
def decode_result():
    return aot.compile_job(DECODE, devices=_devices())


def _state_bytes(job: aot.Job) -> int:
    cfg = job.load()
    _, state = aot.abstract_train_state(cfg)
    leaves = jax.tree.leaves(state)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


def test_train_step_fits_and_state_is_sharded(train_result):
    r = train_result
    assert not r.error and r.fits, r.error
    assert r.num_devices == 4 and r.mesh_shape == {"fsdp": 2, "expert": 2}
    # The donated train state comes back in place: the outputs alias the arguments.
    assert r.alias_bytes > 0.9 * r.output_bytes
    # Parameters and optimizer state are sharded, not replicated: each device holds about 1/4 of them
    # (small vectors and the batch are replicated or split unevenly, hence the slack).
    per_device = _state_bytes(TRAIN) / r.num_devices
    assert 0.8 * per_device < r.argument_bytes < 1.6 * per_device, (r.argument_bytes, per_device)


def test_train_step_flops(train_result):
    r = train_result
    n_active = count_params(TRAIN.load().model)["active"]
    assert r.model_flops == 6 * n_active * TRAIN.batch * TRAIN.seq_len
    # The compiled step does at least the model's FLOPs, and what it adds (attention over 256 tokens,
    # Newton-Schulz, the routing, the worst-case expert buffers) stays within a small factor.
    assert 1.0 < r.flops_ratio < 8.0, r.flops_ratio
    # The loop-count correction matters: XLA counts the scanned groups once.
    assert r.step_flops > r.compiled_flops * r.num_devices


def test_decode_step_fits_with_sharded_cache(decode_result):
    r = decode_result
    assert not r.error and r.fits, r.error
    assert r.alias_bytes > 0  # the cache is donated and updated in place
    cfg = DECODE.load()
    cache = jax.eval_shape(lambda: aot.abstract_model(cfg.model).init_cache(DECODE.batch, DECODE.seq_len))
    cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    params = nnx.state(aot.abstract_model(cfg.model))
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    # One sequence: its cache slots are split over the devices rather than replicated.
    assert r.argument_bytes < (param_bytes + cache_bytes) / r.num_devices * 1.6
    assert 1.0 < r.flops_ratio < 8.0, r.flops_ratio


def test_table_and_rules():
    rows = aot.table([aot.Result(TRAIN, {"fsdp": 2, "expert": 2}, 4, aot.V5P_HBM_BYTES, argument_bytes=1 << 30,
                                 temp_bytes=1 << 30, step_flops=2e12, model_flops=1e12)])
    assert "| small | train 8 x 256 | v5p-8 (4) | fsdp 2 x expert 2 | 8 |" in rows and "| 2.00 |" in rows
    assert aot.TpuSlice.v5p("v5p-1024").num_devices == 512
    with pytest.raises(ValueError, match="unknown slice"):
        aot.TpuSlice.v5p("v5p-3")
