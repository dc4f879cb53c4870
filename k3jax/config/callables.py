"""Callables named in a config as ``package.module:function`` (RL rewards, environments): imported, with
errors that name the field."""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable

from k3jax.config.fields import ConfigError


def import_callable(name: str, field: str) -> Callable:
    """The callable ``package.module:attr[.attr...]`` names; a missing module (or one whose import fails), a
    missing attribute (with close matches) or something not callable raises ``ConfigError`` naming ``field``."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{field}: {name!r}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"{field}: {name!r}: no module named {e.name!r} (is its package installed, or its "
                              "directory on PYTHONPATH?)") from e
        raise ConfigError(f"{field}: {name!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:  # its own import error, a syntax error, ...
        raise ConfigError(f"{field}: {name!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            options = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, options, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"{field}: {name!r}: {getattr(obj, '__name__', module_name)!r} has no attribute "
                              f"{part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}: {name!r} is a {type(obj).__name__}, not a function")
    return obj


__all__ = ["import_callable"]
