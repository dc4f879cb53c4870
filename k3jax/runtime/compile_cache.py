"""JAX's persistent compilation cache, on by default for ``train.py``, ``infer.py``, ``bench/`` and the tests.

XLA:CPU takes minutes to compile the tiny model's train step with its optimisations on; with the
cache a second run of the same program loads the executables in seconds. One call per entry point::

    compile_cache.enable()          # or enable(path) from a flag; "off" disables

Directory, first found: the ``path`` argument (a flag), ``$K3JAX_COMPILE_CACHE``, JAX's own
``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/k3jax/jax`` (``~/.cache/k3jax/jax``). ``off``
(or ``0``, ``none``, ``false``, empty) disables it. JAX's ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
is respected too.
The default directory has one subdirectory per host CPU model and feature set: XLA:CPU compiles for the
host's instruction set and JAX's cache key does not say which, so a home directory shared by different
machines must not share CPU executables.

Safe for concurrent processes (pytest-xdist workers, multi-process runs): a size bound turns on JAX's
file lock around every read and write (an unbounded cache writes entries unlocked, and a reader could
see half a file), and in a multi-process job only process 0 writes (JAX's rule).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform

ENV_VAR = "K3JAX_COMPILE_CACHE"
OFF = ("off", "0", "none", "false", "")
MAX_BYTES = 8 << 30  # least recently used entries are evicted past this
MIN_COMPILE_S = 0.5  # cheaper compiles are not worth a file


def _host_tag() -> str:
    """``<machine>-<hash of the CPU model and feature flags>``."""
    fields = [platform.machine()]
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                fields.append(line)
                if len(fields) == 3:
                    break
    except OSError:
        fields.append(platform.processor())
    return f"{platform.machine() or 'host'}-{hashlib.sha256(chr(10).join(fields).encode()).hexdigest()[:12]}"


def default_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "k3jax" / "jax" / _host_tag()


def resolve(path: str | None = None) -> pathlib.Path | None:
    """The cache directory chosen by ``path``, ``$K3JAX_COMPILE_CACHE`` and the default (None = off)."""
    choice = path if path is not None else os.environ.get(ENV_VAR, os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    if choice is None:
        return default_dir()
    if choice.strip().lower() in OFF:
        return None
    return pathlib.Path(choice).expanduser()


def enable(path: str | None = None) -> pathlib.Path | None:
    """Point JAX's persistent compilation cache at :func:`resolve`'s directory; returns it (None: off).
    Call before the first compile (JAX reads the settings when it first compiles)."""
    import jax

    directory = resolve(path)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return directory


__all__ = ["ENV_VAR", "default_dir", "enable", "resolve"]
