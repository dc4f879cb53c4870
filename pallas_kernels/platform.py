"""The platform a program is built for, the one rule both the kernels and ``k3jax.parallel`` follow.

Here, at the bottom of the import graph (it needs only jax), so that ``k3jax`` can use it without the
kernels importing anything from above.
"""

import jax

# JAX's names for a GPU platform: devices and the default backend say "gpu", lowering and abstract
# devices "cuda" / "rocm".
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# The platforms the kernels and the ragged collectives are built for (anything else interprets / falls back).
ACCELERATORS = ("tpu", "gpu")


def platform_kind(platform: str) -> str:
    """``'gpu'`` for any spelling of a GPU platform (:data:`GPU_PLATFORMS`), else ``platform`` itself."""
    return "gpu" if platform in GPU_PLATFORMS else platform


def target_platform(mesh=None) -> str:
    """``'cpu'``, ``'tpu'``, ``'gpu'`` (CUDA and ROCm alike, :func:`platform_kind`; or the backend's
    name): the platform of ``mesh``'s devices, or without one of the current mesh (``jax.set_mesh``;
    also inside ``shard_map``), else the default backend. An AOT compile for a TPU topology on a CPU
    host thus targets ``'tpu'``, not ``jax.default_backend()``."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if device is not None and not getattr(mesh, "empty", False):
        return platform_kind(device.platform)
    return platform_kind(jax.default_backend())


def resolve_backend(interpret, backend):
    """Return ``(interpret_arg, backend)`` for ``pl.pallas_call``.

    backend: ``"tpu"`` (Mosaic TPU), ``"gpu"`` (Triton) or None (the target platform's; on CPU the TPU
    kernel is interpreted). interpret: None = interpret when the target platform (``pallas_kernels.platform.target_platform``)
    is neither a TPU nor a GPU; True = the generic Pallas interpreter; a ``pltpu.InterpretParams`` is
    passed through (TPU-semantics interpreter: simulated VMEM/DMA, NaN-filled scratch).

    The platform must be known at trace time. ``jax.export(..., platforms=["cuda"])`` on a CPU host traces
    before it names the platform, so ``target_platform()`` is ``"cpu"`` there: pass ``backend="gpu",
    interpret=False``, or trace under a GPU mesh (``jax.sharding.use_abstract_mesh`` with an
    ``AbstractDevice(..., platform="cuda")``), as the TPU AOT path does with a topology mesh.
    """
    platform = target_platform()
    if backend is None:
        backend = "gpu" if platform == "gpu" else "tpu"
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'tpu', 'gpu' or None, got {backend!r}")
    if interpret is None:
        interpret = platform not in ACCELERATORS
    return interpret, backend


__all__ = ["ACCELERATORS", "GPU_PLATFORMS", "platform_kind", "resolve_backend", "target_platform"]
