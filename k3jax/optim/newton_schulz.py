"""Per-block Newton-Schulz orthogonalisation for Muon (``k3jax.optim``), and where it runs.

:func:`orthogonalize_blocks` is optax's ``orthogonalize_via_newton_schulz`` over the blocks that
``MuonDimensionNumbers`` cut a weight into (per head, per expert, or whole), with the blocks of equal
shape from different weights iterated as one batch. The rest of the module decides where each block
is iterated: on a mesh, every block whole on one device (:func:`_spread_blocks`), stacked routed experts
several layers per step (:func:`layers_per_step`), large single blocks in their storage sharding; on
XLA:CPU without a mesh, small blocks one at a time. None of it changes a value: each block's iteration
is its own.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers as MDN

from k3jax.sharding import expert_mesh_axes, spec_entry

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic iteration's (a, b, c), as Muon / Moonlight / K2


def orthogonalize_blocks(xs: Sequence[jax.Array], dim_nums: Sequence[MDN], *, ns_coeffs=NS_COEFFS,
                         ns_steps: int = 5, eps: float = 1e-8,
                         group_max_size: int = 1 << 22) -> list[jax.Array]:
    """Newton-Schulz orthogonalisation of every block of every array, as ``optax.contrib``'s
    ``orthogonalize_via_newton_schulz`` with the same dimension numbers (Frobenius
    pre-normalisation per block, the short side first), but blocks of equal shape from different
    arrays are stacked and iterated together: one batched NS per distinct block shape instead of
    one per parameter. That keeps the compiled optimizer smaller (the tiny model has ~150 Muon
    leaves and ~15 block shapes). Arrays larger than ``group_max_size`` elements run on their own, so large
    sharded weights are never concatenated; their batch axes are kept apart rather than flattened
    (flattening ``[layers, experts]`` would merge an unsharded major axis with a sharded minor one,
    which GSPMD can only do by replicating the experts), and a stacked weight (two or more batch
    axes, e.g. ``[layers, experts, in, out]``) is iterated one leading slice at a time
    (``lax.map``), so the Gram matrices of one layer, not of all 22 K3 layer groups, exist at once.
    On XLA:CPU without a mesh, a batch of small blocks (``CPU_BLOCK_LOOP_ELEMENTS``) is iterated block
    by block instead, which is faster there and gives the same values."""
    a, b, c = (float(v) for v in ns_coeffs)

    def iterate(x):  # [..., r, o], normalised
        for _ in range(ns_steps):
            g = jnp.einsum("...ij,...kj->...ik", x, x)
            g = b * g + c * jnp.einsum("...ij,...jk->...ik", g, g)
            x = a * x + jnp.einsum("...ij,...jk->...ik", g, x)
        return x

    @jax.named_scope("newton_schulz")  # a part name of k3jax.aot.breakdown
    def newton_schulz(x):  # [batch, r, o] with r <= o: NS over the trailing two axes, per block
        x, unspread = _spread_blocks(x)
        norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
        x = x / (norm.astype(x.dtype) + eps)
        if _mesh_devices() == 1 and x.shape[-2] * x.shape[-1] <= CPU_BLOCK_LOOP_ELEMENTS:
            # Same values, block by block on XLA:CPU (its batched dot is the slow part; see the constant).
            return unspread(jax.lax.platform_dependent(x, cpu=lambda x: jax.lax.map(iterate, x), default=iterate))
        return unspread(iterate(x))

    blocks, meta = [], []
    for x, dn in zip(xs, dim_nums):
        single = num_blocks(x, dn) == 1 and x.size < LARGE_BLOCK_ELEMENTS  # -> [1, r, o]: spread with its shape
        view_fn, inverse_fn = _block_view(x, dn, merge_batch=x.size <= group_max_size or single)
        x3 = view_fn(x)  # [batch (one axis, or the original batch axes), reduction, output]
        transposed = x3.shape[-2] > x3.shape[-1]
        if transposed:
            x3 = jnp.swapaxes(x3, -2, -1)
        blocks.append(x3)
        meta.append((inverse_fn, transposed))
    groups: dict[Any, list[int]] = {}
    devices = _mesh_devices()
    for i, x3 in enumerate(blocks):
        # A large array stays alone (never concatenated) unless its blocks are few enough to sit one
        # per device: spread over the mesh, the concatenation is one exchange, and each device
        # orthogonalises at most one block of the lot instead of a share of each array's few.
        together = x3.size <= group_max_size or (devices > 1 and x3.ndim == 3 and x3.shape[0] <= devices)
        key = (x3.shape[1:], x3.dtype) if together else ("alone", i)
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(blocks)
    for idx in groups.values():
        if len(idx) == 1:
            x = blocks[idx[0]]
            out[idx[0]] = jax.lax.map(newton_schulz, x) if x.ndim > 3 else newton_schulz(x)
            continue
        x = newton_schulz(jnp.concatenate([blocks[i] for i in idx], axis=0))
        start = 0
        for i in idx:
            n = blocks[i].shape[0]
            out[i] = x[start:start + n]
            start += n
    result = []
    for x3, (inverse_fn, transposed) in zip(out, meta):
        if transposed:
            x3 = jnp.swapaxes(x3, -2, -1)
        result.append(inverse_fn(x3))
    return result


def _mesh_devices() -> int:
    """Devices of the current (abstract) mesh; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.size


def spread_whole_stack(num_blocks: int) -> bool:
    """Whether a stacked weight with ``num_blocks`` Newton-Schulz blocks (all its layers) is updated
    whole rather than one layer at a time: when the blocks fit one per device of the current mesh.
    One layer of such a weight (a shared expert, a latent projection: one block) would be padded to
    the device count and every device would orthogonalise a block, once per layer; the whole stack
    spread is one block per device for all the layers, and its temporaries are one block's."""
    devices = _mesh_devices()
    return devices > 1 and num_blocks <= devices


# A weight that is one Newton-Schulz block this large (elements) or larger is orthogonalised in its storage
# sharding, each matmul split over the devices that hold it (K3's and K2's dense FFN, [7168, 33792] and
# [7168, 18432]: measured at its analytic share per device); a smaller one joins the blocks of its shape
# and is spread, whole, over the mesh (a shared expert's [6144, 7168] in its storage sharding repeated the
# r^3 of G G on every device: 17x its share for K3's shared experts).
LARGE_BLOCK_ELEMENTS = 1 << 26

# Newton-Schulz blocks this small (elements) or smaller are iterated one block at a time (``lax.map``) on
# XLA:CPU without a mesh, each block's 15 matmuls back to back in cache: its batched dot ran [1152, 128, 128]
# blocks at 34 GFLOP/s on 2 cores where a loop of 2-D dots runs NS at 101 (36 x [256, 256]: 137 -> 186;
# [8, 128, 1024] blocks are faster batched, 163 vs 136). Identical values; TPU / GPU keep the batch.
CPU_BLOCK_LOOP_ELEMENTS = 1 << 16

# Newton-Schulz blocks a device works on at once when layers of a stack are updated together: bounds the
# optimizer's temporaries (K3's routed-expert blocks are [3072, 3584], ~0.1 GB of bf16 work each).
MAX_BLOCKS_PER_DEVICE_STEP = 16


def layers_per_step(x: jax.Array, dn: MDN) -> int:
    """Layers of the stacked weight ``x [layers, E, ...]`` (axis 1 a batch axis: stacked experts) whose
    momentum and Newton-Schulz run together, in one step of the update's loop (a last, shorter step takes
    the layers left over): :func:`best_layers_per_step`. The spread (:func:`_spread_blocks`) pads each
    expert group's blocks to a multiple of its devices: full K3 on v5p-2048 has 14 experts per group of 16
    devices, so one layer at a time is 16 blocks' work for 14 (22 per device over the 22 layers) where 11
    layers at a time is 154 padded to 160 (20); on v5p-1024 (groups of 8 devices) one layer at a time is 44
    blocks per device for 38.5 (1.14x), 4 at a time 5 x 7 + a last step of 2 layers' 4 = 39; K2 on v5p-512
    (6 experts per group of 4 devices, 60 layers): 2 layers, 90 blocks per device instead of 120.
    1 without a mesh, or when axis 1 is not a batch axis."""
    mesh = jax.sharding.get_abstract_mesh()
    red, out = normalized_axes(x.ndim, dn)
    if mesh.empty or mesh.size == 1 or x.ndim < 4 or 1 in red + out:
        return 1
    num_layers, per_layer = x.shape[0], num_blocks(x, dn) // x.shape[0]
    groups = _expert_groups(mesh, per_layer)
    return best_layers_per_step(num_layers, per_layer // groups, mesh.size // groups)


def _expert_groups(mesh, num_blocks: int) -> int:
    """The groups :func:`_spread_blocks` splits ``num_blocks`` blocks into, each spread over its own
    ``mesh.size / groups`` devices: the ``expert`` axis's size when it divides the blocks (stacked experts
    stay in their expert group), else 1."""
    experts = math.prod(dict(mesh.shape).get(a, 1) for a in expert_mesh_axes(None))
    return experts if num_blocks % experts == 0 else 1


def split_over_experts(x: jax.Array, axis: int) -> jax.Array:
    """``x`` constrained to be split over ``expert`` along ``axis``, its other axes left to the compiler.
    For the several-layers-per-step path: without it XLA:TPU lost the experts' split of the merged batch
    (whole batches of blocks on every device: 169 GiB of temporaries for 4 K2 layers) and of the stacked
    results (4.98 TB for K2's PLAN row)."""
    mesh = jax.sharding.get_abstract_mesh()
    experts = expert_mesh_axes(None)  # the `expert` rule's axes (k3jax.sharding)
    if mesh.empty or not experts or not set(experts) <= set(mesh.axis_names) \
            or x.shape[axis] % math.prod(dict(mesh.shape)[a] for a in experts):
        return x
    spec = [jax.sharding.PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[axis] = spec_entry(experts)
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def best_layers_per_step(num_layers: int, blocks_per_group: int, devices_per_group: int,
                         max_blocks_per_step: int = MAX_BLOCKS_PER_DEVICE_STEP) -> int:
    """The ``n`` with the fewest padded blocks per device in all when the stack runs ``num_layers // n``
    steps of ``n`` layers and a last step of the ``num_layers % n`` left (if any):
    ``num_layers // n * ceil(n * blocks_per_group / devices_per_group)`` plus the last step's, among those
    that give a device at most ``max_blocks_per_step`` blocks per step (1 always qualifies). On a tie, a
    divisor of ``num_layers`` (no last step to compile), then the smallest (the temporaries grow with it)."""
    def step_blocks(n):
        return -(-n * blocks_per_group // devices_per_group)

    ok = [n for n in range(1, num_layers + 1) if n == 1 or step_blocks(n) <= max_blocks_per_step]
    return min(ok, key=lambda n: (num_layers // n * step_blocks(n) + step_blocks(num_layers % n),
                                  num_layers % n > 0, n))


def _spread_blocks(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """Split the blocks ``x [B, r, o]`` over every device of the current mesh, each block whole on one
    device: ``B`` zero-padded to a multiple of the device count and sharded over all mesh axes.

    A weight stored sharded over several axes (e.g. ``fsdp x sequence`` on top of ``expert``) would
    otherwise be gathered and orthogonalised in full by every device that holds a piece of it (8.5x
    the analytic count per device for full K3 on v5p-2048, docs/scale.md). The ``expert`` axis is the
    spread's major factor and the padding goes at the end of each expert group: the large batches are
    stacked experts, whose ``B`` is already split over ``expert`` (``sharding.DEFAULT_RULES``), so each
    block stays in its expert group and the spread is an all-to-all inside the group. Another order
    moves blocks between groups, which GSPMD did by gathering the whole batch on every device (an
    all-reduce of the full padded batch, 11 GB per K2 layer and matrix). Values are unchanged: each
    block's iteration is its own, and a zero block stays zero (``0 / (0 + eps)``). Returns the spread
    blocks and the function that undoes it. No mesh (or one device): unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or x.ndim != 3:
        return x, lambda y: y
    P = jax.sharding.PartitionSpec
    n, r, o = x.shape
    groups = _expert_groups(mesh, n)
    per_group, pad = n // groups, -(n // groups) % (mesh.size // groups)

    def pad_groups(y):  # [n, r, o] -> [groups * (per_group + pad), r, o], padding at each group's end
        y = jnp.pad(y.reshape(groups, per_group, r, o), ((0, 0), (0, pad), (0, 0), (0, 0)))
        return y.reshape(groups * (per_group + pad), r, o)

    def unpad_groups(y):
        return y.reshape(groups, per_group + pad, r, o)[:, :per_group].reshape(n, r, o)

    experts = expert_mesh_axes(None)
    spread = P(tuple(sorted(mesh.axis_names, key=lambda a: a not in experts)), None, None)  # expert first
    if any(t != jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.lax.with_sharding_constraint(pad_groups(x), spread), unpad_groups
    orig = tuple(jax.typeof(x).sharding.spec) + (None,) * 3  # explicit axes: the sharding is in the type

    def unspread(y):  # drop the padding on an unsplit batch axis, then back to x's sharding
        return jax.sharding.reshard(unpad_groups(jax.sharding.reshard(y, P(None, *orig[1:3]))), P(*orig[:3]))

    return jax.sharding.reshard(pad_groups(x), spread), unspread


def normalized_axes(ndim: int, dn: MDN) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(reduction axes, output axes) of dimension numbers as tuples of non-negative ints."""
    def norm(a):
        return tuple(i % ndim for i in ((a,) if isinstance(a, int) else a))
    return norm(dn.reduction_axis), norm(dn.output_axis)


def _block_view(x: jax.Array, dn: MDN, *, merge_batch: bool):
    """``(view_fn, inverse_fn)``: ``x`` as ``[batch, reduction, output]`` with the reduction and output
    axes merged and the batch axes (those in neither) merged into one when ``merge_batch`` (the layout
    of ``optax.contrib``'s Muon), kept as they are otherwise; and back."""
    red, out = normalized_axes(x.ndim, dn)
    batch = tuple(i for i in range(x.ndim) if i not in red + out)
    perm = batch + red + out
    batch_shape = tuple(x.shape[i] for i in batch)
    shape = ((math.prod(batch_shape),) if merge_batch else batch_shape) + (
        math.prod(x.shape[i] for i in red), math.prod(x.shape[i] for i in out))
    unflat = tuple(x.shape[i] for i in perm)
    inverse = tuple(sorted(range(x.ndim), key=lambda i: perm[i]))
    return (lambda v: v.transpose(perm).reshape(shape)), (lambda v: v.reshape(unflat).transpose(inverse))


def num_blocks(x: jax.Array, dn: MDN) -> int:
    """Newton-Schulz blocks of ``x``: the product of its axes that are neither reduction nor output."""
    red, out = normalized_axes(x.ndim, dn)
    return math.prod(n for i, n in enumerate(x.shape) if i not in red + out)


def drop_leading_axis(dn: MDN) -> MDN:
    """The dimension numbers of ``x[i]`` given those of ``x`` (axis 0 a batch axis)."""
    def shift(a):
        return tuple(shift(b) for b in a) if isinstance(a, tuple) else (a - 1 if a >= 0 else a)
    return MDN(reduction_axis=shift(dn.reduction_axis), output_axis=shift(dn.output_axis))
