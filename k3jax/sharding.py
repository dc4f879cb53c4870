"""Device meshes and logical-axis sharding rules.

Every parameter carries logical axis names (``out_sharding`` metadata, e.g. ``('layers', 'expert',
'expert_in', 'expert_mlp')``); optimizer state inherits its parameter's names (``nnx.Optimizer``
copies the metadata), and batches and decoding caches get theirs here (:data:`BATCH_LOGICAL_AXES`,
:data:`CACHE_AXES`). A rule table maps each logical name to mesh axes, so a user changes a layout
without touching model code.

One table rules both the automatic (GSPMD) and the manual (``jax.shard_map``) layouts: the
``k3jax.parallel`` regions derive their PartitionSpecs and collective axes from it (the batch and
time axes from ``batch`` / ``length``, heads from ``heads``, the expert-parallel axes from
``expert``: :func:`expert_mesh_axes`, :func:`token_mesh_axes`). Functions taking ``rules`` default
to the active table: :data:`DEFAULT_RULES`, or the one :func:`axis_rules` sets around a program.

Rule semantics (MaxText's convention, made shape-aware): a rule lists candidates, each one mesh axis
or a tuple of them; the first candidate that still has a usable axis wins, where usable means of size
> 1 and not already taken by another dimension of the same array that claimed it first: dimensions claim
in the order their names appear in the table (so a name listed later is a fallback, as ``embed`` in the
serving tables, split where the heads do not divide the devices). Of a tuple, the free axes are
used, trailing ones dropped until their product divides the dimension. So ``embed -> (fsdp, sequence, expert)``
shards dense weights over every data-parallel device (FSDP over the sequence and expert axes too,
which full K3 needs to fit), while in a routed-expert weight ``expert`` has already taken the expert
axis and ``expert_in -> (fsdp, sequence)`` takes the rest; a batch of 1 on a data-parallel mesh is
simply replicated.

Mesh axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism with parameters and optimizer
state sharded), ``expert`` (routed experts; also splits the batch and, as FSDP, the dense weights),
``sequence`` (context) and ``tensor`` (heads / FFN width).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax.cache import KDACache, MLACache, ModelCache
from k3jax.config import MeshConfig

# ------------------------------------------------------------------ the mesh a program runs under
# Layers ask current_mesh at trace time; the shard_map regions of k3jax.parallel split each dimension
# over the axes that divide it (odd batch sizes, one decode token, are replicated over the rest).


def current_mesh() -> jax.sharding.AbstractMesh | None:
    """The abstract mesh of the enclosing ``jax.set_mesh`` with more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    if any(t == AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis ``name`` (1 when the mesh lacks it or there is no mesh)."""
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)


def split_axes(mesh, candidates, size: int) -> tuple[str, ...]:
    """The candidate axes (in order, sizes > 1) whose running product divides ``size``."""
    chosen, product = [], 1
    for name in candidates:
        n = axis_size(mesh, name)
        if n > 1 and size % (product * n) == 0:
            chosen.append(name)
            product *= n
    return tuple(chosen)


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dimension split over ``axes`` (None when unsplit)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

Rules = tuple[tuple[str, tuple], ...]

# The axes a dense weight is stored split over (FSDP), in mesh order (see "embed" below).
FSDP_STORAGE_AXES = ("fsdp", "expert", "sequence")

# logical name -> candidate mesh axes (first usable one wins; a tuple entry shards over several axes).
DEFAULT_RULES: Rules = (
    # The data-like axes, in mesh order.
    ("batch", (("data", "fsdp", "expert"),)),
    # The time axis: over `sequence` and every data-like axis the batch leaves free (the batch rule comes
    # first), so one long row with fewer rows than data-parallel devices still puts distinct tokens on
    # each device (k3jax/parallel/sequence.py runs its token-mixing ops over the same axes).
    ("length", (("data", "fsdp", "expert", "sequence"),)),
    # A decoding cache's rows (MLA's latent cache): as the batch in training's layout; the serving layout
    # (SERVING_DECODE) splits them where the decode batch's activations stay whole.
    ("cache_batch", (("data", "fsdp", "expert"),)),
    # A decoding cache's slots: split over every axis the (often tiny) decode batch leaves free, so a
    # single 1M-token sequence is spread over the whole slice.
    ("cache_length", (("sequence", "data", "fsdp", "expert", "tensor"),)),
    ("vocab", ("tensor",)),
    # FSDP: dense weights are stored split over every axis that splits the batch or the sequence (the
    # expert axis too, which full K3 needs to fit); they are gathered at use (WEIGHT_USE_RULES). The
    # axes go in mesh order: tiled in another order, a shard's devices are not contiguous in the mesh
    # and XLA:TPU gathers (and reduces gradients) with whole-array all-reduces instead of all-gathers
    # (reduce-scatters), twice the bytes.
    ("embed", (FSDP_STORAGE_AXES,)),
    ("heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("expert_in", (("fsdp", "sequence"),)),
    ("expert_mlp", ("tensor",)),
    ("layers", ()),
    ("head_dim", ()),
    # Storage only (FSDP): MLA's q_b / kv_b have no embed axis, and heads alone (96 or 64) would leave
    # them replicated; at use they are gathered (WEIGHT_USE_RULES).
    ("q_lora", (FSDP_STORAGE_AXES,)),
    ("kv_lora", (FSDP_STORAGE_AXES,)),
    ("latent", ()),
    ("gate_rank", ()),
    ("conv", ()),
    ("norm", ()),
)

# How a weight is laid out where it is used: gathered over the data-parallel (FSDP) axes, still split
# over the model-parallel ones (the names not listed here are replicated).
WEIGHT_USE_RULES: Rules = (
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("expert_mlp", ("tensor",)),
)



@dataclasses.dataclass(frozen=True)
class Layout:
    """The two tables of one kind of program: ``rules`` (storage and activations) and ``weight_use`` (the
    layout a weight is gathered to at use, :func:`gather_weight`)."""

    name: str
    rules: Rules
    weight_use: Rules

    def active(self):
        """A ``with`` block in which this layout's tables are the active ones (:func:`axis_rules`)."""
        return axis_rules(self.rules, self.weight_use)


# Training: FSDP storage, weights gathered at use, the batch and the time axis split over the data axes.
TRAINING = Layout("training", DEFAULT_RULES, WEIGHT_USE_RULES)

# The serving layout (decode and prefill share the weights' storage). A decode step carries a few tokens
# per row: gathering an FSDP-stored weight for them moves the weight over the network every step
# (110.9 GB per device and step for full K3 on v5p-64, docs/scale.md). Instead each weight is stored once,
# split over every device along a dimension its use keeps split (tensor parallelism over the whole
# slice: heads, FFN and latent columns, vocabulary; expert parallelism for the routed experts), so a step
# reads its shard from local HBM and moves only activations: the partial sums of row-parallel
# projections (all-reduced), the tokens of the expert exchange, the queries of the attention. Norms, the
# short convolutions and KDA's low-rank gate up-projections are replicated (a few MB per layer of K3).
MODEL_PARALLEL = (MESH_AXES,)  # one candidate: every mesh axis, trailing ones dropped until the dimension divides
SERVING_WEIGHT_RULES: Rules = (
    ("vocab", MODEL_PARALLEL),
    ("heads", MODEL_PARALLEL),
    ("mlp", MODEL_PARALLEL),
    ("latent", MODEL_PARALLEL),
    ("expert", MODEL_PARALLEL),
    # The low ranks: MLA's q_a / kv_a and KDA's gate down-projections split by output column (their small
    # outputs are gathered for the up-projections, which split by head); q_b / kv_b by rank where their heads
    # do not divide the devices.
    ("q_lora", MODEL_PARALLEL),
    ("kv_lora", MODEL_PARALLEL),
    ("gate_rank", MODEL_PARALLEL),
    # The fallback, claimed last: the model dimension of a weight whose heads do not divide the devices (K3's
    # 96 over 64: row-parallel, the partial sums all-reduced), and of the residual stream's vectors.
    ("embed", MODEL_PARALLEL),
    *((name, ()) for name in ("expert_in", "expert_mlp", "layers", "head_dim", "conv", "norm")),
)
# Decode: the batch's activations whole on every device (a few KB per token), the MLA cache's rows split
# over the devices (each attends its own rows with every head: the queries move, not the cache), its slots
# over what the rows leave (one long sequence: flash-decoding, k3jax/parallel/cache_attention.py); KDA's
# states split by head as its projections are. Nothing is gathered at use.
SERVING_DECODE_RULES: Rules = (("batch", ()), ("length", ()), ("cache_batch", MODEL_PARALLEL),
                               ("cache_length", MODEL_PARALLEL), *SERVING_WEIGHT_RULES)
SERVING_DECODE = Layout("serving decode", SERVING_DECODE_RULES, SERVING_DECODE_RULES)
# Prefill: a chunk of many tokens per row is compute-bound, so it keeps training's activation layout
# (tokens split over the slice) and gathers each dense weight at use as training does (once per chunk);
# the routed experts stay where they are stored.
SERVING_PREFILL = Layout(
    "serving prefill",
    (*((n, r) for n, r in DEFAULT_RULES if n in ("batch", "length", "cache_batch", "cache_length")),
     *SERVING_WEIGHT_RULES),
    (*((n, r) for n, r in WEIGHT_USE_RULES if n != "expert"), ("expert", MODEL_PARALLEL)))
LAYOUTS = {"training": (TRAINING, TRAINING), "serving": (SERVING_DECODE, SERVING_PREFILL)}  # (decode, prefill)

# The active tables (axis_rules): read at trace time, like the mesh of jax.set_mesh.
_ACTIVE: contextvars.ContextVar[tuple[Rules, Rules]] = contextvars.ContextVar(
    "k3jax_axis_rules", default=(DEFAULT_RULES, WEIGHT_USE_RULES))


@contextlib.contextmanager
def axis_rules(rules: Rules, weight_use_rules: Rules | None = None):
    """Make ``rules`` (and ``weight_use_rules``, the layout at use of :func:`gather_weight`) the active
    tables inside the ``with`` block: every function of this module called without ``rules``, and the
    ``shard_map`` regions of ``k3jax.parallel``, follow them. The tables are read when a function is
    traced: a ``jax.jit`` function traced under one table keeps it (enter the block around the whole
    program, tracing included, as with ``jax.set_mesh``)."""
    use = WEIGHT_USE_RULES if weight_use_rules is None else weight_use_rules
    token = _ACTIVE.set((tuple(rules), tuple(use)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_rules() -> Rules:
    """The active rule table (:data:`DEFAULT_RULES` outside :func:`axis_rules`)."""
    return _ACTIVE.get()[0]


def current_weight_use_rules() -> Rules:
    """The active layout-at-use table (:data:`WEIGHT_USE_RULES` outside :func:`axis_rules`)."""
    return _ACTIVE.get()[1]


# The text arrays of a training batch (``k3jax.data``), all ``[B, T]``, and their logical axes.
TEXT_BATCH_KEYS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")
BATCH_LOGICAL_AXES = ("batch", "length")

# Logical axes of the decoding cache's arrays (``k3jax.cache``), without the leading stacked-group
# axis that the scanned layers' caches carry (it gets ``layers``).
CACHE_AXES: dict[type, tuple[tuple[str | None, ...], ...]] = {
    KDACache: (("batch", "heads", "head_dim", None),  # state [B, H, K, V]
               ("batch", "conv", "heads"),  # conv_q [B, W-1, H*K]: the flat channel axis is head-major
               ("batch", "conv", "heads"),
               ("batch", "conv", "heads")),
    MLACache: (("cache_batch", "cache_length", "kv_lora"),  # ckv [B, S, r]
               ("cache_batch", "cache_length", None)),  # k_rope [B, S, R]
}
_CACHE_SCALARS = {"length": (), "positions": ("cache_batch",), "valid": ("cache_batch", "cache_length")}


def make_mesh(cfg: MeshConfig, devices: Sequence | None = None) -> Mesh:
    """A mesh with axes ``MESH_AXES`` sized by the config (one ``-1`` fills the remaining devices).

    ``devices``: real devices, fake CPU devices or a TPU topology's device descriptions
    (``jax.experimental.topologies.get_topology_desc(...).devices``, for AOT compiles).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [getattr(cfg, a) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1:
        raise ValueError("mesh: at most one axis may be -1")
    if -1 in sizes:
        if len(devices) % fixed:
            raise ValueError(f"mesh: {len(devices)} devices do not divide by the fixed axes' product {fixed}")
        sizes[sizes.index(-1)] = len(devices) // fixed
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def parse_mesh(text: str, default: MeshConfig = MeshConfig(data=1)) -> MeshConfig:
    """``"fsdp=8,expert=64"`` -> MeshConfig (unlisted axes: ``default``'s sizes; ``-1`` fills)."""
    sizes = {a: getattr(default, a) for a in MESH_AXES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.lstrip("-").isdigit():
            raise ValueError(f"mesh {text!r}: expected axis=size pairs over {', '.join(MESH_AXES)}, got {part!r}")
        sizes[name] = int(value)
    cfg = MeshConfig(**sizes)
    cfg.validate("mesh")
    return cfg


def logical_to_spec(axes: Sequence[str | None], rules: Rules | None = None, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> P:
    """PartitionSpec of one array from its logical axis names (see the module docstring).

    Without ``mesh`` every named axis counts as usable; without ``shape`` divisibility is not checked.
    """
    table = dict(current_rules() if rules is None else rules)
    rank = {name: r for r, name in enumerate(table)}
    used: set[str] = set()
    out: list = [None] * len(axes)
    # the dimensions claim mesh axes in the order of their names in the table (a fallback name listed later)
    for i in sorted(range(len(axes)), key=lambda i: (rank.get(axes[i], len(rank)), i)):
        name = axes[i]
        chosen: tuple[str, ...] = ()
        for cand in table.get(name, ()) if name is not None else ():
            group = [a for a in (cand if isinstance(cand, tuple) else (cand,))
                     if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1)]
            if mesh is not None and shape is not None:
                while group and shape[i] % math.prod(mesh.shape[a] for a in group):
                    group.pop()
            if group:
                chosen = tuple(group)
                break
        used.update(chosen)
        out[i] = None if not chosen else chosen[0] if len(chosen) == 1 else chosen
    return P(*out)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis or a tuple of axes), as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_mesh_axes(mesh, rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes the routed experts are split over, the ``expert`` rule's (what the expert weights'
    storage uses): the axes of the expert-parallel exchange. () when no axis of ``mesh`` is usable;
    without a mesh, the rule's first candidate."""
    return spec_axes(logical_to_spec(("expert",), rules, mesh)[0])


def token_mesh_axes(mesh, num_tokens: int, rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes ``num_tokens`` flattened ``[batch * length]`` tokens split over in a per-token
    ``shard_map`` region, so that each device owns distinct tokens: the ``batch`` rule's axes, then the
    ``length`` rule's, then the mesh's other axes, each taken when its size keeps dividing the count."""
    if mesh is None:
        return ()
    table = dict(current_rules() if rules is None else rules)
    ruled = [a for name in ("batch", "length") for cand in table.get(name, ()) for a in spec_axes(cand)]
    order = list(dict.fromkeys(ruled + list(mesh.axis_names)))
    return split_axes(mesh, order, num_tokens)


def named_sharding(mesh: Mesh, axes: Sequence[str | None] | None, shape: Sequence[int],
                   rules: Rules | None = None) -> NamedSharding:
    """The NamedSharding of one array of ``shape`` with logical ``axes`` (None: replicated)."""
    spec = logical_to_spec(axes, rules, mesh, shape) if axes else P()
    return NamedSharding(mesh, spec)


def gather_weight(w: jax.Array, axes: Sequence[str | None] | None, rules: Rules | None = None) -> jax.Array:
    """``w`` constrained to its layout at use (``rules``, default the active :data:`WEIGHT_USE_RULES`)
    under the current mesh: the FSDP all-gather, made explicit. Without it GSPMD may keep a weight split
    along its contracting (``embed``) dimension, the same mesh axes that split the batch, and resolve the
    conflict by replicating the activations instead (the full K3 batch's MoE activations on every device).
    Identity without a mesh or inside ``shard_map``. ``axes``: the weight's logical names; inside the
    layer scan a stacked weight has lost its leading ``layers`` axis, so only the last ``w.ndim``
    names apply.

    ``w`` (a weight just cast to the compute dtype) is first pinned to the storage layout, so the cast
    runs on each device's shard and the gather moves compute-dtype values: left free, sharding
    propagation moved the gather back through ``ops.weight_cast``'s elementwise ops and gathered its
    operands, the bfloat16 values and the NaN mask (one byte per weight more; 27.7 of the 177 GB of
    collectives of a 9-layer K3 step on v5p-1024), and ``astype``'s convert was moved after the gather
    of the float32 weight in the rematerialised forward. The gather then runs one mesh axis at a time
    (:func:`gather_stages`).
    """
    mesh = current_mesh()
    if mesh is None or not axes:
        return w
    axes = tuple(axes)[len(axes) - w.ndim:]
    use_rules = current_weight_use_rules() if rules is None else rules
    storage = logical_to_spec(axes, None, mesh, w.shape)
    return _gathered(w, gather_stages(storage, logical_to_spec(axes, use_rules, mesh, w.shape)), storage)


def gather_stages(storage: P, use: P) -> tuple[P, ...]:
    """The layouts a weight is constrained to on its way from ``storage`` to ``use``: ``storage``, then
    one mesh axis fewer at each step (the storage axes ``use`` does not split, the minor-most in the
    mesh first), then ``use``.

    Why one axis at a time: XLA:TPU (libtpu 0.10.2) writes an all-gather over every device of a slice
    of 64 or more as a zero-padded buffer all-reduced (``TpuAllGatherDecomposer``), twice the bytes of
    the all-gather, and full K3's dense weights are stored over all 512 devices of v5p-1024. An
    all-gather per mesh axis moves the same bytes as one over all of them (each device receives every
    shard it lacks once), and none of them spans the whole slice unless one mesh axis does."""
    entries = [list(spec_axes(e)) for e in storage]
    kept = {a for e in use for a in spec_axes(e)}
    order = [a for a in MESH_AXES if any(a in e and a not in kept for e in entries)]
    stages = [storage]
    for axis in reversed(order[1:]):  # the last gather goes straight to ``use``
        entries = [[a for a in e if a != axis] for e in entries]
        stages.append(P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)))
    return (*stages, use)


def constrain_activation(x: jax.Array, axes: Sequence[str | None], rules: Rules | None = None) -> jax.Array:
    """``x`` constrained to the layout of its logical ``axes`` (e.g. ``("batch", "length", "mlp")``) under the
    current mesh, its cotangent too; identity without a mesh or inside ``shard_map``. For activations whose
    layout GSPMD would otherwise choose: in the backward of K3's dense FFN on v5p-1024 it split the batch
    rows over 256 devices where the forward had split rows and sequence 128 x 4, and moved between the two
    by gathering the whole [1M tokens, 33792] hidden on every device (1.75 TB of temporaries)."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules, mesh, x.shape))


def keep_split(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``x`` constrained on the dimensions that weights are used split along (its logical ``axes`` under the
    active layout-at-use table), the others left to GSPMD; identity when none is split, without a mesh or
    inside ``shard_map``. For the output of a projection whose weight is used split along that dimension
    (the serving decode layout's latent MoE projections): a consumer that wants the tokens split (the
    expert exchange) otherwise pulls its layout back through the matmul, and GSPMD gathers the weight
    (every step) instead of moving the activation."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(axes, current_weight_use_rules(), mesh, x.shape)
    if all(entry is None for entry in spec):
        return x
    return jax.lax.with_sharding_constraint(x, P(*(P.UNCONSTRAINED if e is None else e for e in spec)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(w, stages: tuple[P, ...], storage: P):
    """``w`` constrained to each of ``stages`` in turn (:func:`gather_stages`: storage to use); its
    cotangent to ``storage`` (the weight's own layout).

    The cotangent arrives as per-device partial sums of the gathered weight's gradient. The plain
    transpose of the constraints would sum them in the gathered layout, an all-reduce of the whole
    matrix on every device; constrained to the storage layout the sum is a reduce-scatter, each
    device receiving only its shard (half the bytes, and no whole-matrix gradient in memory). The
    stages do not apply to it: a constraint on partial sums sums them whole."""
    for spec in stages:
        w = jax.lax.with_sharding_constraint(w, spec)
    return w


def _gathered_fwd(w, stages, storage):
    return _gathered(w, stages, storage), None


def _gathered_bwd(stages, storage, _, cotangent):
    return (jax.lax.with_sharding_constraint(cotangent, storage),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def _value_of(var):
    return var.get_raw_value() if isinstance(var, nnx.Variable) else var


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None):
    """NamedShardings for every Variable of an NNX state (model, optimizer or whole train state),
    from its ``out_sharding`` names; a prefix tree of ``state`` (one sharding per Variable)."""

    def one(var):
        value = _value_of(var)
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        shape = getattr(value, "shape", None)
        if shape is None:  # optax's MaskedNode and other leafless placeholders
            return NamedSharding(mesh, P())
        return named_sharding(mesh, axes, shape, rules)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_with_shardings(state: Any, shardings: Any) -> Any:
    """``state`` (arrays or ShapeDtypeStructs, in Variables or not) as ShapeDtypeStructs carrying
    ``shardings`` (a prefix tree of ``state``, as :func:`state_shardings` returns): the argument of
    ``jit(...).lower`` for an AOT compile."""

    def place(sharding, subtree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree)

    return jax.tree.map(place, shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))


def place_state(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> tuple[nnx.State, bool]:
    """(``state`` laid out by ``rules`` on ``mesh``, whether anything moved): arrays already in their
    layout stay as they are (no copy); the others are copied device to device, and the call waits for
    them."""
    target = state_shardings(state, mesh, rules)
    leaves = jax.tree.leaves(state)
    wanted = jax.tree.leaves(target, is_leaf=lambda x: isinstance(x, NamedSharding))
    if all(getattr(x, "sharding", None) is not None and s.is_equivalent_to(x.sharding, x.ndim)
           for x, s in zip(leaves, wanted)):
        return state, False
    placed = jax.tree.map(lambda s, v: jax.device_put(v, s), target, state,
                          is_leaf=lambda x: isinstance(x, NamedSharding))
    return jax.block_until_ready(placed), True


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Place a model's variables on ``mesh`` according to the rules (in place; returns the model)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    values = jax.tree.map(lambda v: v.get_raw_value(), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placed = jax.device_put(values, jax.tree.map(lambda s: s, shardings))
    nnx.update(model, placed)
    return model


def batch_sharding(mesh: Mesh, rules: Rules | None = None, shape: Sequence[int] | None = None) -> NamedSharding:
    """Sharding of ``[B, T]`` input arrays: batch over the data-like axes, length over ``sequence``
    (axes that do not divide ``shape``, when given, are left out)."""
    return NamedSharding(mesh, logical_to_spec(BATCH_LOGICAL_AXES, rules, mesh, shape))


def batch_array_axes(key: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the batch array ``key``: :data:`BATCH_LOGICAL_AXES` for the ``[B, T]`` text
    arrays, the batch dimension alone for the rest (a vision batch's packed ``image_*`` arrays)."""
    return BATCH_LOGICAL_AXES if ndim == 2 and key in TEXT_BATCH_KEYS else ("batch",) + (None,) * (ndim - 1)


def shard_batch(batch: dict, mesh: Mesh, rules: Rules | None = None) -> dict:
    """This process's rows of a global batch (numpy) -> global arrays on ``mesh``.

    Each array is split as :func:`batch_array_axes` says. Every process passes its
    own ``B / process_count`` rows (``k3jax.data`` reads them), in process order.
    """
    out = {}
    for key, local in batch.items():
        local = np.asarray(local)
        shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
        sharding = named_sharding(mesh, batch_array_axes(key, local.ndim), shape, rules)
        out[key] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out


def place_batch(batch: dict, mesh: Mesh, rules: Rules | None = None) -> dict:
    """A whole global batch (numpy) that every process holds the same -> global arrays on ``mesh``, split
    as :func:`shard_batch` splits them; each process places the shards of its own devices (an RL run's
    batch, computed by every process from the same rollout)."""
    out = {}
    for key, whole in batch.items():
        whole = np.asarray(whole)
        sharding = named_sharding(mesh, batch_array_axes(key, whole.ndim), whole.shape, rules)
        out[key] = jax.make_array_from_callback(whole.shape, sharding, lambda index, whole=whole: whole[index])
    return out


def use_mesh(mesh: Mesh):
    """``jax.set_mesh(mesh)`` for a mesh of several devices; a no-op context for one device, whose
    programs need no mesh (and stay exactly the unsharded single-device programs)."""
    return jax.set_mesh(mesh) if mesh.size > 1 else contextlib.nullcontext()


def cache_shardings(cache: ModelCache, mesh: Mesh, rules: Rules | None = None) -> ModelCache:
    """NamedShardings of a decoding cache (arrays or ShapeDtypeStructs), tree-shaped like it.

    Layer caches use :data:`CACHE_AXES`; the scanned groups' caches have one more leading axis
    (``layers``, never sharded).
    """

    def layer(c):
        names = CACHE_AXES[type(c)]
        return type(c)(*(named_sharding(mesh, (("layers",) * (x.ndim - len(ax))) + ax, x.shape, rules)
                         for x, ax in zip(c, names)))

    def layers(cs):
        return tuple(layer(c) for c in cs)

    scalars = {k: named_sharding(mesh, ax, getattr(cache, k).shape, rules) for k, ax in _CACHE_SCALARS.items()}
    return ModelCache(layers(cache.prefix), layers(cache.groups), layers(cache.suffix), **scalars)
