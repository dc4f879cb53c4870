"""Optimized HLO text as data: its computations and instructions (``parse_hlo``), array types and their
bytes, loop trip counts and the computations an instruction calls. What ``k3jax.aot.breakdown`` reads a
compiled step with."""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f4e2m1fn": 0.5,
                "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*)$", re.DOTALL)  # a statement may span lines
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a string literal: backslash escapes, line breaks
_CALLS = re.compile(r"\b(calls|body|to_apply|branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%[^\s,)]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'known_trip_count[\\"]*:\{[\\"]*n[\\"]*:[\\"]*(\d+)')


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    shape: str  # the result type text, e.g. "bf16[4,128]{1,0}" or a tuple
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a constant's literal)
    attrs: str  # everything after the operand list
    op_name: str


def _split_type(rest: str) -> tuple[str, str]:
    """``'f32[2]{0} add(%a, %b), ...'`` -> (type text, the rest from the opcode on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    i = rest.index(" ")
    return rest[:i], rest[i + 1:]


def _matching(text: str, start: int) -> int:
    """Index just past the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i + 1
    return len(text)


def statements(text: str):
    """The HLO text's statements (module line, computation header, instruction, a computation's closing
    ``}``), one per line unless a string literal or a bracket stays open at the line break: an
    instruction whose backend_config or metadata holds line breaks (a Pallas kernel's, e.g. the
    pretty-printed JSON of MaxText's splash attention) is one statement, and a ``}`` starting one of its
    lines does not end the computation. A computation header ends in the ``{`` that opens its body."""
    pending: list[str] = []
    for line in text.splitlines():
        pending.append(line)
        joined = "\n".join(pending)
        bare = _STRING.sub("_", joined) if '"' in joined else joined
        if '"' in bare:  # a string literal continues on the next line
            continue
        depth = sum(map(bare.count, "({[")) - sum(map(bare.count, ")}]"))
        if depth <= 0 or (depth == 1 and _HEADER.match(joined)):
            yield joined
            pending = []
    if pending:  # unterminated: the text was cut off
        yield "\n".join(pending)


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Optimized HLO text -> ({computation: instructions}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in statements(text):
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2).lstrip("%")
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.lstrip().startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, rest = _split_type(m.group(2))
        paren = rest.find("(")
        if paren < 0:
            continue
        opcode = rest[:paren].strip()
        end = _matching(rest, paren)
        operands = re.findall(r"%([^\s,)]+)", rest[paren:end])
        attrs = rest[end:]
        op = _OP_NAME.search(attrs)
        comps[current].append(Instr(m.group(1), opcode, shape, operands, rest[paren + 1:end - 1], attrs,
                                    op.group(1) if op else ""))
    return comps, entry


def array_types(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)
            if dt in DTYPE_BYTES]


def shape_bytes(shape: str) -> float:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in array_types(shape))


def dims(shape: str) -> tuple[int, ...]:
    arrays = array_types(shape)
    return arrays[0][1] if arrays else ()


def trip_count(ins: Instr, comps: dict[str, list[Instr]], unknown: int = 1) -> int:
    """Iterations of a while loop: XLA's ``known_trip_count`` (CPU / GPU), else read off its condition
    (TPU drops the annotation): ``i < N`` with ``i`` counting up from 0, the scan / fori_loop form; else
    (a data-dependent loop, e.g. the dropless exchange's overflow rounds) ``unknown``."""
    trip = _TRIP.search(ins.attrs)
    if trip:
        return int(trip.group(1))
    cond = re.search(r"condition=%([^\s,]+)", ins.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    consts = {i.name: i for i in body if i.opcode == "constant"}
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2 and i.operands[1] in consts:
            literal = re.fullmatch(r"\s*(-?\d+)\s*", consts[i.operands[1]].args)
            if literal:
                return max(int(literal.group(1)), 0)
    return unknown


def data_dependent(ins: Instr, comps: dict[str, list[Instr]]) -> bool:
    """A while loop whose trip count is not in the HLO (it depends on the data)."""
    return ins.opcode == "while" and trip_count(ins, comps, unknown=-1) == -1


def called_computations(ins: Instr, comps: dict[str, list[Instr]] | None = None,
                        unknown: int = 1) -> list[tuple[str, int]]:
    """(computation, times it runs per run of ``ins``) for the computations ``ins`` calls."""
    out = []
    for key, val in _CALLS.findall(ins.attrs):
        names = re.findall(r"%?([^\s,{}]+)", val)
        if key == "to_apply" and ins.opcode != "call":
            continue  # reductions' scalar combiners
        times = trip_count(ins, comps or {}, unknown) if key == "body" else 1
        out += [(n, times) for n in names]
    return out


__all__ = ["DTYPE_BYTES", "Instr", "array_types", "called_computations", "data_dependent", "dims", "parse_hlo",
           "shape_bytes", "statements", "trip_count"]
