"""Fresh Python processes for tests: the environment they run in, a free port for them, and a check run on
``n`` fake CPU devices (the device count must be set before JAX starts, and the rest of the suite runs on one
device): a module of ``tests/children/`` (:func:`run_child`). Children find this directory on their path, so
they import these helpers."""

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def rel(a, b) -> float:
    """The device checks' error measure: max over the leaves of max|a - b| / max|b|. On the host in numpy:
    eager jnp compiles a program for every leaf shape and sharding (15 of test_parallel's forward check's
    73 s went to such compiles)."""
    import jax
    import numpy as np

    pairs = [(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)) for x, y in pairs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child's server or JAX coordinator to bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def xla_flags(*flags: str) -> str:
    """``$XLA_FLAGS`` (with the suite's codegen setting from conftest.py) and ``flags``: for a child process
    that needs a flag of its own, such as a fake device count."""
    return " ".join(f for f in (os.environ.get("XLA_FLAGS"), *flags) if f)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process: the CPU, this checkout first on the path, XLA's
    optimisation passes off (``JAX_DISABLE_MOST_OPTIMIZATIONS``, as the in-process ``fast_xla`` fixture):
    compiling the tiny model's train step takes about half the time and the values the tests compare
    are unchanged (every process of a test runs with the same setting), and the suite's persistent
    compilation cache (:func:`compile_cache_env`). ``extra`` overrides."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")) if p))
    env.update(compile_cache_env())
    env.update(extra)
    return env


def compile_cache_env() -> dict[str, str]:
    """JAX's settings for the test process's persistent compilation cache (k3jax/runtime/compile_cache.py),
    for a child that does not turn it on itself (the ``children`` modules; ``train.py`` and ``infer.py``
    do): a later run of the suite loads the children's executables instead of compiling them again (the
    8-device checks spend about half their CPU time compiling). Empty when the cache is off."""
    from k3jax.runtime import compile_cache  # here, not above: conftest imports this module before JAX

    directory = compile_cache.resolve()
    if directory is None:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(directory), "JAX_COMPILATION_CACHE_MAX_SIZE": str(compile_cache.MAX_BYTES),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                                                         str(compile_cache.MIN_COMPILE_S))}


def run_child(module: str, *args: str, n: int = 8, timeout: int = 900, **env: str) -> str:
    """Run ``python -m children.<module> args`` (``tests/children/<module>.py``) on ``n`` fake CPU devices,
    ``env`` added to :func:`subprocess_env`'s; it prints ``OK`` when its checks pass. Its output is returned
    (shown on failure)."""
    return _run([sys.executable, "-m", f"children.{module}", *args],
                subprocess_env(**{"JAX_NUM_CPU_DEVICES": str(n), **env}), timeout)


def _run(cmd: list[str], env: dict[str, str], timeout: int) -> str:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout
