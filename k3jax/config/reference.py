"""The configuration reference: every field of every config section (``Config`` and the dataclasses it
nests), with its type, its default and the comments its source gives it, as one Markdown page.

The documentation site renders this page at build time (``docs/hooks.py``), so the reference is the
dataclasses themselves and cannot drift from them. A field's description is the comment block right
above it plus its trailing comment, read from the source with ``tokenize`` (the dataclasses document
their fields with comments, which leave no trace at run time). ``python -m k3jax.config.reference``
prints the page."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal

from k3jax.config.fields import field_types
from k3jax.config.loading import _SECTION_ALIASES
from k3jax.config.run_config import Config


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str
    type: Any  # the resolved annotation
    default: Any
    runtime: bool  # may differ between a checkpoint and the config that resumes it (fields.runtime)
    comment: str


def _comments(cls) -> dict[str, str]:
    """Each annotated field of ``cls`` -> the comment lines right above it and its trailing comment, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    inline = {tok.start[0]: tok.string.lstrip("#").strip()
              for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    (node,) = ast.parse(source).body
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        row = stmt.lineno - 1  # 1-based line above the field
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, inline[row])
            row -= 1
        trailing = [inline[r] for r in range(stmt.lineno, stmt.end_lineno + 1)
                    if r in inline and not lines[r - 1].strip().startswith("#")]
        out[stmt.target.id] = " ".join(part for part in above + trailing if part)
    return out


def fields_of(cls) -> list[FieldDoc]:
    comments, types_ = _comments(cls), field_types(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(FieldDoc(f.name, types_[f.name], default, bool(f.metadata.get("runtime")), comments.get(f.name, "")))
    return out


def sections(cls=Config, path: str = "") -> list[tuple[str, type]]:
    """``(dotted path, dataclass)`` of ``cls`` and every section nested in it, depth first."""
    out = [(path, cls)]
    for f in fields_of(cls):
        if dataclasses.is_dataclass(f.type):
            out += sections(f.type, f"{path}.{f.name}" if path else f.name)
    return out


def _anchor(path: str) -> str:
    return path.replace(".", "-") or "config"


def _type_text(tp: Any, path: str) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return f"section [`{path}`](#{_anchor(path)})"
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_text(inner, path)}, or `null`"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_text(args[0], path)}"
        return f"list of {len(args)} {_type_text(args[0], path)}"
    return f"`{tp.__name__}`"


def _value_text(value: Any) -> str:
    """A default as it is written in YAML or a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return str(value) if value != "" else '""'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("``", "`")


def _docstring(cls) -> str:
    doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n")).replace("``", "`") if doc else ""


def config_reference() -> str:
    """The reference page, Markdown."""
    aliases = {".".join(target): alias for alias, target in _SECTION_ALIASES.items()}
    out = ["# Configuration reference", "",
           "Every field of a k3jax config, section by section: its type, its default (what a YAML file or a "
           "`key=value` override that leaves it out gets) and what it does. This page is generated from the "
           "config dataclasses (`k3jax/config/`) by `k3jax/config/reference.py` each time the site is built "
           "(the `docs/hooks.py` hook of `mkdocs.yml`), so it always matches the code.", "",
           "Set a field in a YAML file under `configs/` (nested as the sections are) or on the command line "
           "by its dotted path: `python train.py --config tiny model.moe.top_k=4 train.steps=50`. "
           "*runtime* marks a field that says how a run executes or is logged rather than what it computes: "
           "it may change when a run resumes.", ""]
    for path, cls in sections():
        title = path or "top level"
        out += [f'## {title} {{ #{_anchor(path)} }}', ""]
        if path in aliases:
            out += [f"Also written as a top-level `{aliases[path]}` section (`{aliases[path]}.*` overrides).", ""]
        if doc := _docstring(cls):
            out += [doc, ""]
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for f in fields_of(cls):
            name = f"{path}.{f.name}" if path else f.name
            nested = dataclasses.is_dataclass(f.type)
            default = "" if nested else f"`{_cell(_value_text(f.default))}`"
            description = "; ".join(part for part in ("*runtime*" if f.runtime else "", _cell(f.comment)) if part)
            out.append(f"| `{name}` | {_cell(_type_text(f.type, name))} | {default} | {description} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m k3jax.config.reference",
                            description="print the configuration reference (Markdown)").parse_args(argv)
    print(config_reference())


__all__ = ["FieldDoc", "config_reference", "fields_of", "sections"]

if __name__ == "__main__":
    main()
