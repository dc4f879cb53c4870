"""The rules every config field follows: errors that name the field, the ``runtime`` mark, and the
``Literal[...]`` choice check (on loading and in ``validate()``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

class ConfigError(ValueError):
    """A config that cannot describe a valid model; the message names the offending field."""


def check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def runtime(default):
    """A field that says how a run executes or is observed, not what it computes: it may differ between a
    checkpoint and the config that resumes or reads it, and HF config round trips ignore it
    (:func:`without_runtime_fields`)."""
    return dataclasses.field(default=default, metadata={"runtime": True})


def runtime_fields(cls) -> frozenset[str]:
    """Names of the fields of config dataclass ``cls`` marked runtime."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("runtime"))


def without_runtime_fields(cfg) -> dict:
    """``to_dict(cfg)`` without the runtime fields, at every depth: what must match for two configs to
    describe the same model (or the same run)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("runtime"):
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = without_runtime_fields(v)
        out[f.name] = list(v) if isinstance(v, tuple) else v  # as to_dict
    return out


def check_choice(value: Any, tp: Any, where: str) -> None:
    """A value of a ``Literal[...]``-annotated field (also ``Literal | None``) must be one of the allowed
    values; the error names the field and lists them. Other annotations pass."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        (tp,) = [a for a in args if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        check(value in typing.get_args(tp), where, f"must be one of {list(typing.get_args(tp))}, got {value!r}")


def check_choices(cfg, prefix: str) -> None:
    """Every ``Literal[...]``-annotated field of ``cfg`` and of its nested configs holds an allowed value
    (configs built in Python skip :func:`_coerce`, which checks the same rule on loading)."""
    for name, tp in field_types(type(cfg)).items():
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}.{name}")
        else:
            check_choice(value, tp, f"{prefix}.{name}")



def field_types(cls) -> dict[str, Any]:
    """The resolved annotation of each field of config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


__all__ = ["ConfigError", "check", "check_choice", "check_choices", "field_types", "runtime", "runtime_fields",
           "without_runtime_fields"]
