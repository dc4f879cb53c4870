"""Where a compiled step's FLOPs, HBM bytes and collective bytes go, read off its optimized HLO.

::

    python -m k3jax.aot --config k3 --mode train ... --breakdown        # table + JSON per compiled job

XLA's ``cost_analysis`` gives one number, counts every loop body once and a kernel (custom call) as
zero. This module reads the optimized HLO text of a compiled program (``compiled.as_text()``, parsed by
``k3jax.aot.hlo_text``) and counts each instruction itself:

- **Matmul FLOPs**: ``dot`` = ``2 * |output| * |contracted dims|``; ``convolution`` (TPU writes
  dots as convolutions: a batch dimension as a window whose ``lhs_dilate`` equals its size, an output
  dimension as a window padded on both sides) = ``2 * input features * (output element, window tap)
  pairs that read real input`` (not padding, not a dilation hole); a Pallas / Mosaic kernel (``tpu_custom_call``) = the
  ``pl.CostEstimate`` it declares; a ragged dot custom call = ``2 * rows * in * out``.
- **HBM bytes**: operands + result of every instruction outside fusion bodies (a fusion reads its
  operands and writes its result once; what happens inside stays in registers / VMEM), where only part
  of a buffer is touched counting that part: a (dynamic) slice's slice, an in-place dynamic update's
  update (``_traffic``).
- **Collective bytes**: per kind (all-gather, reduce-scatter, all-reduce, all-to-all, ragged
  all-to-all, collective-permute), the bytes one device sends, ``(n - 1) / n`` of the gathered /
  scattered / exchanged array (twice that for an all-reduce, a reduce-scatter plus an all-gather).
- **Trip counts**: every computation gets a multiplier, the number of times it runs per step:
  while bodies multiply by their ``known_trip_count`` (the scanned layer groups, the micro-batch
  loop, chunk loops), fusions / calls inherit their caller's; a conditional counts its costliest
  branch only (which branch runs is known at run time only: an upper bound). A while loop whose trip
  count depends on the data (the dropless exchange's overflow rounds, which run only when a device's
  pairs exceed a round) counts ``data_dependent_trips`` times: once by default, and ``--breakdown``
  also reports the step with them not run.

**Attribution** uses the ``jax.named_scope`` names the model puts on its parts (``PARTS``): an
instruction belongs to the innermost part named in its ``op_name`` metadata (relative names inside
called computations are prefixed with the caller's). **Phase**: ``recompute`` for rematerialised
forward work (``rematted_computation``), ``backward`` under ``transpose(...)``, ``optimizer`` for the
update, else ``forward``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from k3jax.aot.hlo_text import (Instr, array_types, called_computations, data_dependent, dims, parse_hlo,
                              shape_bytes)

# The named scopes of the model and the train step (k3jax/model.py, layers/, optim/newton_schulz.py, training/step.py).
PARTS = ("embedding", "kda", "mla", "attn_res", "router", "routed_experts", "shared_experts", "latent_proj",
         "dense_ffn", "lm_head_loss", "newton_schulz", "optimizer", "quantile_balancing", "vision")
PHASES = ("forward", "backward", "recompute", "optimizer")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
               "collective-permute")
OPTIMIZER_PARTS = ("newton_schulz", "optimizer", "quantile_balancing")

_COST_FLOPS = re.compile(r'cost_estimate[\\"]*:\s*\{[\\"]*flops[\\"]*:\s*[\\"]*(\d+)')
_NO_TRAFFIC = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "copy-start", "copy-done", "opt-barrier"}


def _instr_flops(ins: Instr, shapes: dict[str, str]) -> float:
    if ins.opcode == "dot":
        return _dot_flops(ins, shapes)
    if ins.opcode == "convolution":
        return _conv_flops(ins, shapes)
    if ins.opcode == "custom-call":
        return _custom_call_flops(ins, shapes)
    return 0.0


def _untaken_branches(comps: dict[str, list[Instr]], unknown: int = 1) -> set[tuple[str, str]]:
    """(conditional instruction, branch) pairs not counted: a conditional runs one branch per call, which
    one is only known at run time, so it counts its costliest branch (an upper bound; e.g. the exact
    rather than the dense path of a KDA chunk, a causal block's attention rather than its skip)."""
    memo: dict[str, float] = {}

    def total(comp: str) -> float:  # FLOPs of one run of comp, callees included (max over branches)
        if comp not in memo:
            memo[comp] = 0.0  # guards cycles, which HLO does not have
            instrs = comps.get(comp, [])
            shapes = {i.name: i.shape for i in instrs}
            flops = 0.0
            for ins in instrs:
                flops += _instr_flops(ins, shapes)
                callees = called_computations(ins, comps, unknown)
                if ins.opcode == "conditional":
                    flops += max((total(c) for c, _ in callees), default=0.0)
                else:
                    flops += sum(total(c) * t for c, t in callees)
            memo[comp] = flops
        return memo[comp]

    skipped = set()
    for instrs in comps.values():
        for ins in instrs:
            if ins.opcode == "conditional":
                branches = [c for c, _ in called_computations(ins, comps)]
                costliest = max(branches, key=total, default=None)
                skipped |= {(ins.name, c) for c in branches if c != costliest}
    return skipped


def multipliers(comps: dict[str, list[Instr]], entry: str,
                unknown: int = 1) -> tuple[dict[str, float], dict[tuple[str, str], str], set[tuple[str, str]]]:
    """Runs per step of every computation reachable from ``entry``, every instruction's full name, and
    the instructions whose name is only a guess.

    The name is the instruction's op_name, prefixed with its first caller's when relative. One whose
    name holds no part (no metadata: XLA's own rewrites, e.g. the dense transpose of a ragged dot, or
    the zero-padded buffer of a gather written as an all-reduce) takes the name of an operand that has
    one, the latest in the step (a backward operand makes it backward work); failing that, its
    computation's (the caller's name). Scalar operands (indices, e.g. a dynamic slice's offsets, and
    constants XLA shares between parts) are not followed. A name is a guess when it comes from a
    computation whose caller has no part of its own (a conditional or loop named after one of its
    operands, e.g. a state tensor of the balancing bias): constants, broadcasts and index arithmetic
    so named are never followed, and a collective so named is not put under a part (``breakdown``)."""
    edges = collections.defaultdict(list)
    indegree = collections.Counter()
    untaken = _untaken_branches(comps, unknown)
    for comp, instrs in comps.items():
        for ins in instrs:
            for callee, times in called_computations(ins, comps, unknown):
                if callee in comps:
                    edges[comp].append((callee, 0 if (ins.name, callee) in untaken else times, ins))
                    indegree[callee] += 1
    mult = collections.defaultdict(float, {entry: 1.0})
    context = {entry: ""}
    trusted_context = {entry: False}  # whether a computation's caller has a part of its own
    names: dict[tuple[str, str], str] = {}
    guessed: set[tuple[str, str]] = set()
    ready = [c for c in comps if indegree[c] == 0]
    while ready:
        comp = ready.pop()
        local: dict[str, str] = {}
        trusted: set[str] = set()  # named by their own op_name, or after a trusted caller
        scalars = {ins.name for ins in comps[comp] if _is_scalar(ins.shape)}
        for ins in comps[comp]:  # operands come first in HLO text
            name = full_name(ins.op_name, context.get(comp, "")) if ins.op_name else ""
            if part_of(name) != "other":
                trusted.add(ins.name)
            else:  # unnamed, or named outside every part (XLA's own ops)
                named = [local[o] for o in ins.operands if part_of(local.get(o, "")) != "other"
                         and (comp, o) not in guessed and o not in scalars]  # indices say nothing
                if named:
                    name = max(named, key=_phase_rank)
                else:
                    name = name or context.get(comp, "")
                    if trusted_context.get(comp, False):
                        trusted.add(ins.name)
                    else:
                        guessed.add((comp, ins.name))
            local[ins.name] = names[(comp, ins.name)] = name
        for callee, times, ins in edges[comp]:
            mult[callee] += mult[comp] * times
            if callee not in context:
                context[callee] = local[ins.name]
                trusted_context[callee] = ins.name in trusted
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return mult, names, guessed


def _is_scalar(shape: str) -> bool:
    arrays = array_types(shape)
    return len(arrays) == 1 and not arrays[0][1] and not shape.startswith("(")


def full_name(op_name: str, context: str) -> str:
    if not op_name or op_name.startswith("jit(") or not context:
        return op_name or context
    return f"{context}/{op_name}"


def _scope_names(name: str) -> list[str]:
    """Path components with transformation wrappers removed: ``transpose(jvp(kda))`` -> ``kda``."""
    out = []
    for comp in name.split("/"):
        while "(" in comp and comp.endswith(")"):
            comp = comp[comp.index("(") + 1:-1]
        out.append(comp)
    return out


def _phase_rank(name: str) -> int:
    return {"forward": 0, "recompute": 1, "backward": 2, "optimizer": 3}[phase_of(name, part_of(name))]


def part_of(name: str) -> str:
    """The innermost named part in an op_name, ``other`` when none."""
    for comp in reversed(_scope_names(name)):
        if comp in PARTS:
            return comp
    return "other"


def phase_of(name: str, part: str) -> str:
    if part in OPTIMIZER_PARTS:
        return "optimizer"
    if "rematted_computation" in name:
        return "recompute"
    return "backward" if "transpose(" in name else "forward"


def _real_pairs(n: int, out: int, size: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one window dimension that read a real input element, not
    padding nor a hole of ``lhs_dilate``: tap w of output o reads ``x = o * stride + w * rhs_dilate - pad_lo``
    of the dilated input ``[0, (n - 1) * lhs_dilate]``, real when ``x % lhs_dilate == 0``."""
    import numpy as np  # noqa: PLC0415 - only convolutions need it

    o = np.arange(out, dtype=np.int64)[:, None]
    total = 0
    for w0 in range(0, size, 4096):  # bounded memory for long windows
        w = np.arange(w0, min(size, w0 + 4096), dtype=np.int64)[None, :]
        x = o * stride + w * rhs_dilate - pad_lo
        total += int(np.count_nonzero((x >= 0) & (x <= (n - 1) * lhs_dilate) & (x % lhs_dilate == 0)))
    return total


def _conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """``2 * in_features * (output elements x window taps that read real input)``. TPU writes a dot's
    output dimension as a padded window (a head axis of size h: window h, padding h - 1 on each side,
    one real tap per output) and a batch dimension as a window with ``lhs_dilate`` equal to its size;
    counting every tap of the window would multiply those dots by h."""
    labels = re.search(r"dim_labels=([^\s,]+)", ins.attrs)
    if not labels or len(ins.operands) < 2:
        return 0.0
    (lhs_labels, rhs_labels), out_labels = labels.group(1).split("->")[0].split("_"), labels.group(1).split("->")[1]
    lhs, rhs, out = (dims(shapes.get(ins.operands[0], "")), dims(shapes.get(ins.operands[1], "")),
                     dims(ins.shape))
    if not rhs or not lhs or not out:
        return 0.0
    in_features = rhs[rhs_labels.index("i")]
    spatial = sorted((c for c in lhs_labels if c.isdigit()), key=int)  # window dims go by spatial index
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(kv.split("=", 1) for kv in window.group(1).split() if "=" in kv) if window else {}
    n = len(spatial)

    def ints(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * n

    sizes, strides = ints("size", 1), ints("stride", 1)
    lhs_dil, rhs_dil = ints("lhs_dilate", 1), ints("rhs_dilate", 1)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
    other = math.prod(out)  # output elements over the window dimensions' positions, times real pairs
    pairs = 1
    for d, c in enumerate(spatial):
        out_n = out[out_labels.index(c)]
        other //= out_n
        pairs *= _real_pairs(lhs[lhs_labels.index(c)], out_n, sizes[d], strides[d], pads[d], lhs_dil[d], rhs_dil[d])
    return 2.0 * other * pairs * in_features


def _dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
    lhs = dims(shapes.get(ins.operands[0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
    return 2.0 * math.prod(dims(ins.shape)) * k


def _custom_call_flops(ins: Instr, shapes: dict[str, str]) -> float:
    cost = _COST_FLOPS.search(ins.attrs)
    if cost:
        return float(cost.group(1))
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    if target and "ragged" in target.group(1).lower() and "dot" in target.group(1).lower():
        lhs = dims(shapes.get(ins.operands[0], ""))
        out = dims(ins.shape)
        return 2.0 * math.prod(out) * (lhs[-1] if lhs else 1)
    return 0.0


def _group_size(ins: Instr) -> int:
    groups = re.search(r"replica_groups=\{\{([0-9,]*)\}", ins.attrs)
    if groups:
        return max(1, len([g for g in groups.group(1).split(",") if g]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", ins.attrs)  # iota form [groups, size]
    if iota:
        return int(iota.group(2))
    # mesh form: replica_groups=mesh['axis_0'=128,'axis_1'=2] (device_ids=(...))? {'axis_0','axis_1'}:
    # a group spans the listed axes
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", ins.attrs)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    return 1


def _collective(ins: Instr, shapes: dict[str, str], comps: dict[str, list[Instr]]) -> tuple[str, float] | None:
    kind = ins.opcode.removesuffix("-start")
    n = None
    if ins.opcode == "fusion":
        # XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and the slice each device
        # keeps (``calls=%all-reduce-scatter...``); the pair runs as one reduce-scatter.
        inner = [i for callee, _ in called_computations(ins) if callee.startswith("all-reduce-scatter")
                 for i in comps.get(callee, ()) if i.opcode in ("all-reduce", "all-reduce-start")]
        if not inner:
            return None
        kind, n = "reduce-scatter", _group_size(inner[0])
    if kind not in COLLECTIVES or ins.opcode.endswith("-done"):
        return None
    n = _group_size(ins) if n is None else n
    operand = sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    if kind == "ragged-all-to-all":
        operand = shape_bytes(shapes.get(ins.operands[0], ""))
    result = shape_bytes(ins.shape)
    if kind == "all-gather":
        sent = result * (n - 1) / n if n > 1 else result
    elif kind == "reduce-scatter":
        sent = operand * (n - 1) / n if n > 1 else operand
    elif kind == "all-reduce":
        sent = 2 * operand * (n - 1) / n if n > 1 else operand
    elif kind == "collective-permute":
        sent = operand
    else:  # all-to-all: all but one's own block leaves
        sent = operand * (n - 1) / n if n > 1 else operand
    return kind, sent


def _collective_parts(ins: Instr, coll: tuple[str, float], comp: str, names: dict[tuple[str, str], str],
                      guessed: set[tuple[str, str]], shapes: dict[str, str]) -> list[tuple[str, float]]:
    """(part, bytes) of one collective: its own op_name's part; else, by what it carries, each
    operand's part for its share of the bytes (XLA combines the gathers and gradient sums of several
    parts into one collective of a tuple, with no op_name); ``other`` (unattributed) for what carries
    no part or only a guessed one (``multipliers``)."""
    if part_of(ins.op_name) != "other":
        return [(part_of(ins.op_name), coll[1])]
    sizes = [(o, shape_bytes(shapes.get(o, ""))) for o in ins.operands]
    total = sum(b for _, b in sizes)
    if coll[0] == "ragged-all-to-all" or len(sizes) < 2 or not total:
        return [("other" if (comp, ins.name) in guessed else part_of(names.get((comp, ins.name), "")), coll[1])]
    return [("other" if (comp, o) in guessed else part_of(names.get((comp, o), "")), coll[1] * b / total)
            for o, b in sizes]


def _sent_dtypes(ins: Instr, shapes: dict[str, str]) -> str:
    """The element types a collective sends: its operands' (an async start's result tuple also holds
    its output and scalar context), e.g. ``bf16`` or ``f32,u32``."""
    return ",".join(sorted({dt for o in ins.operands for dt, _ in array_types(shapes.get(o, ""))})) or "none"


@dataclasses.dataclass
class Breakdown:
    """Per-device totals of one step; keys ``(part, phase)``."""

    flops: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    hbm_bytes: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    collective_bytes: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))  # by kind
    collective_by_part: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    # by (kind, the dtypes sent, e.g. "bf16"): a weight's gather in its compute dtype, or in float32 / as
    # its cast's intermediates (u32 bits, a pred mask packed into u32) where the cast ran after it
    collective_by_dtype: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    unattributed_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    data_dependent_loops: float = 0.0  # runs of while loops whose trip count depends on the data

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def part_flops(self, part: str) -> float:
        return sum(v for (p, _), v in self.flops.items() if p == part)

    def phase_flops(self, phase: str) -> float:
        return sum(v for (_, ph), v in self.flops.items() if ph == phase)

    @property
    def attributed_share(self) -> float:
        total = self.total_flops
        return 1.0 - self.part_flops("other") / total if total else 1.0

    def to_json(self) -> dict:
        parts = sorted({p for p, _ in self.flops} | {p for p, _ in self.hbm_bytes})
        return {
            "total_flops": self.total_flops,
            "attributed_share": self.attributed_share,
            "parts": {p: {"flops": {ph: self.flops.get((p, ph), 0.0) for ph in PHASES},
                          "hbm_bytes": sum(v for (q, _), v in self.hbm_bytes.items() if q == p),
                          "collective_bytes": self.collective_by_part.get(p, 0.0)} for p in parts},
            "collective_bytes": dict(self.collective_bytes),
            "collective_bytes_by_dtype": {f"{k} {dt}": v for (k, dt), v in sorted(self.collective_by_dtype.items())},
            "unattributed_top": self.unattributed_ops.most_common(10),
            "data_dependent_loops": self.data_dependent_loops,
        }


def breakdown(hlo_text: str, data_dependent_trips: int = 1) -> Breakdown:
    """Count the per-device FLOPs, HBM bytes and collective bytes of one step (module docstring), with
    every data-dependent loop run ``data_dependent_trips`` times."""
    comps, entry = parse_hlo(hlo_text)
    mult, names, guessed = multipliers(comps, entry, data_dependent_trips)
    fused = {callee for instrs in comps.values() for ins in instrs if ins.opcode == "fusion"
             for callee, _ in called_computations(ins)}
    out = Breakdown()
    for comp, instrs in comps.items():
        times = mult.get(comp, 0.0)
        if not times:
            continue
        shapes = {ins.name: ins.shape for ins in instrs}
        for ins in instrs:
            name = names.get((comp, ins.name), ins.op_name)
            part = part_of(name)
            key = (part, phase_of(name, part))
            flops = _instr_flops(ins, shapes)
            if flops:
                out.flops[key] += times * flops
                if part == "other":
                    out.unattributed_ops[name] += times * flops
            if comp in fused:
                continue
            if data_dependent(ins, comps):
                out.data_dependent_loops += times
            coll = _collective(ins, shapes, comps)
            if coll:
                out.collective_bytes[coll[0]] += times * coll[1]
                out.collective_by_dtype[(coll[0], _sent_dtypes(ins, shapes))] += times * coll[1]
                for carried, sent in _collective_parts(ins, coll, comp, names, guessed, shapes):
                    out.collective_by_part[carried] += times * sent
            if ins.opcode not in _NO_TRAFFIC and not ins.opcode.endswith("-done"):
                out.hbm_bytes[key] += times * _traffic(ins, shapes, comps)
    return out


_SLICES = ("dynamic-slice", "slice")


def _traffic(ins: Instr, shapes: dict[str, str], comps: dict[str, list[Instr]]) -> float:
    """HBM bytes one run of ``ins`` (outside fusion bodies) moves: its result written and its operands read,
    except where it touches part of a buffer (a decode step's loops walk a 1M-slot cache a block at a time,
    and update it in place): a dynamic slice reads its slice; an in-place dynamic-update-slice reads and
    writes its update, not the buffer; a fusion reads only the slices of an operand its body reads through
    (dynamic) slices, and a fusion whose root updates an operand in place writes the update."""
    if ins.opcode == "dynamic-slice":
        return 2 * shape_bytes(ins.shape)
    if ins.opcode == "dynamic-update-slice":
        return 2 * shape_bytes(shapes.get(ins.operands[1], ""))
    callees = [c for c, _ in called_computations(ins)] if ins.opcode == "fusion" else []
    body = comps.get(callees[0]) if callees else None
    if not body:
        return shape_bytes(ins.shape) + sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    params = _fusion_params(body)
    root = body[-1]
    updates = [u for u in (body if root.opcode == "tuple" else [root]) if u.opcode == "dynamic-update-slice"
               and (root.opcode != "tuple" or u.name in root.operands)]
    in_place = {u.operands[0]: u for u in updates}
    inner = {i.name: i.shape for i in body}
    total = 0.0 if updates else shape_bytes(ins.shape)
    total += sum(2 * shape_bytes(inner.get(u.operands[1], "")) for u in updates)
    if updates and root.opcode == "tuple":  # the tuple's other elements are written whole
        total += sum(shape_bytes(inner.get(o, "")) for o in root.operands if o not in {u.name for u in updates})
    for index, operand in enumerate(ins.operands):
        name = params.get(index)
        users = [u for u in body if name is not None and name in u.operands]
        if name in in_place and users == [in_place[name]]:
            continue  # the buffer updated in place: its update counted above
        whole = shape_bytes(shapes.get(operand, ""))
        total += whole if name is None else _read_bytes(body, name, whole, comps)
    return total


_ELEMENTWISE = ("bitcast", "copy", "convert", "transpose")


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in array_types(shape))


def _shape_of(body: list[Instr], name: str) -> str:
    return next((i.shape for i in body if i.name == name), "")


def _fusion_params(body: list[Instr]) -> dict[int, str]:
    """A fused computation's parameters: {index: name}."""
    return {int(i.args): i.name for i in body if i.opcode == "parameter" and i.args.strip().isdigit()}


def _read_bytes(body: list[Instr], name: str, whole: float, comps: dict[str, list[Instr]]) -> float:
    """What a fused computation reads of its value ``name`` (``whole`` bytes): the slices it takes when every
    use is a (dynamic) slice, through bitcasts and nested fusions; else ``whole``."""
    total = 0.0
    for user in (u for u in body if name in u.operands):
        if user.opcode in _SLICES and user.operands[0] == name:
            total += shape_bytes(user.shape)
        elif user.opcode in _ELEMENTWISE or (user.opcode == "fusion" and _elements(user.shape) == _elements(
                _shape_of(body, name)) and len(user.operands) == 1):
            # an element-for-element op (a layout change, a cast, a nested elementwise fusion): a fusion computes
            # only the elements its slices take
            total += _read_bytes(body, user.name, whole, comps)
        elif user.opcode == "fusion" and user.operands.count(name) == 1:
            callees = [c for c, _ in called_computations(user)]
            inner = comps.get(callees[0], []) if callees else []
            param = _fusion_params(inner).get(user.operands.index(name))
            total += whole if param is None else _read_bytes(inner, param, whole, comps)
        else:
            return whole
    return min(total, whole)


def table(b: Breakdown, analytic: dict[str, float] | None = None, *, devices: int = 1) -> str:
    """Markdown: part, FLOPs by phase, share, analytic FLOPs (all devices', ``k3jax.aot.analytic.step_flops``)
    and the ratio (all per device)."""
    analytic = analytic or {}
    total = b.total_flops or 1.0
    rows = ["| part | forward | backward | recompute | optimizer | total FLOPs | share | analytic | ratio | HBM GB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    parts = sorted({p for p, _ in b.flops} | set(analytic), key=lambda p: -b.part_flops(p))
    for p in parts:
        f = b.part_flops(p)
        a = analytic.get(p, 0.0) / devices
        hbm = sum(v for (q, _), v in b.hbm_bytes.items() if q == p) / 1e9
        rows.append(f"| {p} | " + " | ".join(f"{b.flops.get((p, ph), 0.0):.3e}" for ph in PHASES)
                    + f" | {f:.3e} | {f / total:.1%} | {a:.3e} | {(f / a if a else float('nan')):.2f} | {hbm:.1f} |")
    rows.append("| **total** | " + " | ".join(f"{b.phase_flops(ph):.3e}" for ph in PHASES)
                + f" | {b.total_flops:.3e} | 100% | {sum(analytic.values()) / devices:.3e} | "
                + f"{b.total_flops / (sum(analytic.values()) / devices) if analytic else float('nan'):.2f} | "
                + f"{sum(b.hbm_bytes.values()) / 1e9:.1f} |")
    return "\n".join(rows)
