"""Shared test setup: make the repo importable without an editable install; the persistent compilation
cache (k3jax/runtime/compile_cache.py: a second test run loads its executables; xdist workers and subprocesses
share it safely); XLA settings for tests that compile whole models."""

import contextlib
import os
import pathlib
import sys

# Tests run on the CPU. With jax[tpu] installed (for the tpu_aot compile tests) libtpu must not try to
# claim a TPU, and parallel test workers must not fight over libtpu's lock file.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# XLA:CPU's loop emitters instead of its MLIR fusion emitters (read when the backend starts, so for the
# whole test process and, through the environment, its child processes; tests/cpu_devices.xla_flags adds
# a child's own flags to it): the 6-layer tiny's forward + backward compiles in about half the time and
# runs as fast; every test passes with its tolerances unchanged. Production runs keep XLA's default.
from cpu_devices import xla_flags  # noqa: E402 (imports no JAX)

os.environ["XLA_FLAGS"] = xla_flags("--xla_cpu_use_fusion_emitters=false")

import pytest

_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from k3jax.runtime import compile_cache  # noqa: E402

compile_cache.enable()


# The longest files, longest first (their summed test times in a cold run of 843 tests on one worker,
# session 20, less what that session cut: about 255, 200, 140, 125, 125, 115, 105, 90, 85, 75, 70, 70, 65,
# 60, 60, 60, 55 s; the rest take 50 s or less). Only the order in which xdist hands out files depends on
# it; a stale list costs wall time, never a result.
LONGEST_FILES = ("test_model.py", "test_lora.py", "test_aot.py", "test_pod_job.py", "test_serving.py",
                 "test_quant_qat.py", "test_optim.py", "test_lm_eval.py", "test_parallel.py",
                 "test_cached_prefill_parallel.py", "test_gcs.py", "test_multihost_serving.py", "test_pallas_gpu.py",
                 "test_decode.py", "test_long_context.py", "test_expert_parallel.py", "test_train_mesh.py")


def pytest_configure(config):
    """pytest-xdist sorts the files by their number of tests unless told not to (its
    ``--no-loadscope-reorder``); the order chosen below is what it should keep."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The longest files first, then the other files with ``slow`` or ``tpu_aot`` tests, then the rest.
    pytest-xdist (``--dist loadfile``) hands each worker the next whole file as it becomes free, so a
    long file handed out last leaves the other worker idle (longest first). Order within a file is kept."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("tpu_aot")}

    def rank(item):
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES) + (item.path not in heavy)

    items.sort(key=rank)


@contextlib.contextmanager
def _fast_xla_settings():
    import jax

    saved = {"jax_disable_most_optimizations": jax.config.values.get("jax_disable_most_optimizations", False),
             "jax_default_matmul_precision": jax.config.jax_default_matmul_precision}
    jax.config.update("jax_disable_most_optimizations", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


@pytest.fixture(scope="module")
def fast_xla():
    """Opt in with ``pytestmark = pytest.mark.usefixtures("fast_xla")``.

    - ``jax_disable_most_optimizations``: XLA:CPU compiles the tiny model 3-7x faster without its
      optimisation passes (read at compile time); these tests check values, not speed.
    - ``jax_default_matmul_precision = highest``: float32 matmuls in full precision on every backend
      (the default on CPU; TPUs would otherwise use bf16 passes), so float64 references apply.

    Both are restored after the module.
    """
    with _fast_xla_settings():
        yield


@pytest.fixture
def fast_xla_test():
    """``fast_xla`` for one test (``@pytest.mark.usefixtures("fast_xla_test")``) in a module whose other
    tests keep XLA's optimisations (e.g. tests that inspect compiled TPU programs)."""
    with _fast_xla_settings():
        yield
