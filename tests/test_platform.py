"""One rule for the platform a program is built for (``pallas_kernels.platform``): every spelling JAX
gives a GPU is one platform to the kernels' backend choice, the expert exchange and ``model.*_impl``."""

import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from k3jax import kernels
from k3jax.parallel.expert import resolve_dispatch
from pallas_kernels.platform import ACCELERATORS, GPU_PLATFORMS, platform_kind, resolve_backend, target_platform


def mesh_of(platform: str) -> AbstractMesh:
    return AbstractMesh((2,), ("expert",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice("chip", None, platform))


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_every_gpu_spelling_is_one_platform(platform):
    mesh = mesh_of(platform)
    assert platform_kind(platform) == "gpu" and target_platform(mesh) == "gpu"
    # a GPU mesh, whatever its spelling: the ragged exchange, the Triton backend compiled, ragged_dot experts
    assert resolve_dispatch("auto", mesh) == "ragged_all_to_all"
    with jax.sharding.use_abstract_mesh(mesh):
        assert resolve_backend(None, None) == (False, "gpu")
    assert kernels.resolve_moe_impl("auto", target_platform(mesh)) == kernels.AUTO_MOE["gpu"]


def test_tpu_and_cpu_platforms():
    assert ACCELERATORS == ("tpu", "gpu")
    assert platform_kind("tpu") == "tpu" and platform_kind("cpu") == "cpu"
    assert resolve_dispatch("auto", mesh_of("tpu")) == "ragged_all_to_all"
    assert resolve_dispatch("auto", mesh_of("cpu")) == "all_gather"
    with jax.sharding.use_abstract_mesh(mesh_of("tpu")):
        assert resolve_backend(None, None) == (False, "tpu")
    with jax.sharding.use_abstract_mesh(mesh_of("cpu")):
        assert resolve_backend(None, None) == (True, "tpu")  # the TPU kernel, interpreted
    # no mesh: the default backend (the suite runs on the CPU)
    assert target_platform() == platform_kind(jax.default_backend()) == "cpu"
