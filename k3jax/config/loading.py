"""Configs from YAML and dotted ``key=value`` overrides, with strict key and type checking, and back
to plain dicts. ``load_config("k3")`` reads ``configs/k3.yaml``; a path to any YAML file works too, and so
does a model directory (a Hugging Face model, a k3jax run or checkpoint): the config that fine-tunes it
(``k3jax/interop/model_dir.py``).
Unknown keys, typos and inconsistent values fail at load time with a message that names the field
(and suggests the closest valid name)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from k3jax.config.fields import ConfigError, check_choice, field_types
from k3jax.config.run_config import Config
from k3jax.runtime import storage

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent.parent / "configs"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, where)
    if origin is Literal:
        check_choice(value, tp, where)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, _) = typing.get_args(tp)
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string; Python reads it as a number
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} at {where}")


def _from_dict(cls, data: dict, where: str):
    types_ = field_types(cls)
    unknown = [k for k in data if k not in types_]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(types_), n=1)
        hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
        raise ConfigError(f"{where + '.' if where else ''}{k}: unknown key{hint} "
                          f"(valid: {', '.join(sorted(types_))})")
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """The config as plain nested dicts/lists (YAML- and JSON-serialisable)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# Top-level sections that are aliases of a deeper one (``quant.experts=...`` is ``model.quant.experts=...``).
_SECTION_ALIASES = {"quant": ("model", "quant")}


def _resolve_aliases(data: dict) -> dict:
    """Move aliased top-level sections (YAML or overrides) to where they live in the config."""
    out = dict(data)
    for alias, (section, field) in _SECTION_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            target = dict(out.get(section) or {})
            current = target.get(field)
            target[field] = merge_nested(current, value) if isinstance(current, dict) and isinstance(value, dict) else value
            out[section] = target
    return out


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {p} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    """``["model.moe.top_k=4", "train.steps=10"]`` -> nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def merge_nested(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_nested(out[k], v)
        else:
            out[k] = v
    return out


def resolve_path(name_or_path: str) -> pathlib.Path:
    p = pathlib.Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        return p
    if len(p.parts) > 1:  # a path, not a config's name
        raise ConfigError(f"{p} does not exist (expected a config YAML file or a model directory)")
    p = CONFIG_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown config {name_or_path!r}; named configs: {', '.join(names)}")
    return p


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load ``configs/<name>.yaml`` (or a YAML path), or the config that fine-tunes a model directory (a
    local directory or a URL: ``k3jax/interop/model_dir.py``), and apply dotted ``key=value`` overrides.

    A config may start with ``base: <name>`` to inherit another config and override some fields.
    """
    if storage.is_remote(name_or_path) or pathlib.Path(name_or_path).is_dir():
        # above config/: it reads HF config.json and orbax checkpoints
        from k3jax.interop.model_dir import directory_config

        data = directory_config(name_or_path)
    else:
        data = _load_yaml(resolve_path(name_or_path))
        data.setdefault("name", pathlib.Path(name_or_path).stem)
    data = merge_nested(_resolve_aliases(data), _resolve_aliases(parse_overrides(overrides)))
    cfg = _from_dict(Config, data, "")
    cfg.validate()
    return cfg


def _load_yaml(path: pathlib.Path, seen: tuple = ()) -> dict:
    if path in seen:
        raise ConfigError(f"{path}: circular 'base'")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is not None:
        parent = _load_yaml(resolve_path(base), seen + (path,))
        parent.pop("name", None)
        data = merge_nested(parent, data)
    return data


# Keys that configs saved by earlier versions (a checkpoint's config) carry but that are gone, with the one
# value each could take: :func:`from_dict` drops them when they hold it. ``model.moe.router_dtype`` was
# never read: the router always computes in float32 (k3jax/layers/latent_moe.py), as the references do.
RETIRED_KEYS = {("model", "moe", "router_dtype"): "float32"}


def _without_retired(data: dict) -> dict:
    """``data`` without the :data:`RETIRED_KEYS` that hold their one value (a copy where any is dropped)."""
    for (*parents, key), value in RETIRED_KEYS.items():
        node = data
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(key, ()) == value:
            data = copy.deepcopy(data)
            node = functools.reduce(dict.__getitem__, parents, data)
            del node[key]
    return data


def from_dict(data: dict) -> Config:
    """Build and validate a Config from nested dicts (e.g. the ``to_dict`` of a saved run; the retired
    keys of earlier versions' configs are dropped, :data:`RETIRED_KEYS`)."""
    cfg = _from_dict(Config, _resolve_aliases(_without_retired(data)), "")
    cfg.validate()
    return cfg


__all__ = ["CONFIG_DIR", "from_dict", "load_config", "merge_nested", "parse_overrides", "resolve_path", "to_dict"]
