"""The platform a program is built for, the one rule both the kernels and ``k3jax.parallel`` follow.

Here, at the bottom of the import graph (it needs only jax), so that ``k3jax`` can use it without the
kernels importing anything from above.
"""

import jax


def target_platform(mesh=None) -> str:
    """``'cpu'``, ``'tpu'``, ``'gpu'`` (or the backend's name): the platform of ``mesh``'s devices, or
    without one of the current mesh (``jax.set_mesh``; also inside ``shard_map``), else the default
    backend. An AOT compile for a TPU topology on a CPU host thus targets ``'tpu'``, not
    ``jax.default_backend()``."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if device is not None and not getattr(mesh, "empty", False):
        return device.platform
    return jax.default_backend()


__all__ = ["target_platform"]
