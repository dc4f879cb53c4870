"""The persistent compilation cache (k3jax/runtime/compile_cache.py): where it goes, how it is turned off, and
that concurrent processes share it (two writers at once, then a reader that hits)."""

import os
import subprocess
import sys

import pytest

from cpu_devices import ROOT, TESTS
from k3jax.runtime import compile_cache

def test_resolve_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = compile_cache.resolve()
    assert default.parent == tmp_path / "xdg" / "k3jax" / "jax"
    assert default.name.startswith(os.uname().machine)  # one directory per host CPU
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_env"))
    assert compile_cache.resolve() == tmp_path / "jax_env"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "ours"))
    assert compile_cache.resolve() == tmp_path / "ours"
    assert compile_cache.resolve(str(tmp_path / "flag")) == tmp_path / "flag"
    for off in ("off", "OFF", "0", "none", ""):
        assert compile_cache.resolve(off) is None
        monkeypatch.setenv(compile_cache.ENV_VAR, off)
        assert compile_cache.resolve() is None


def _probe(cache_dir, extra_env=None):
    """A process compiling one small function with the cache (``tests/children/compile_cache_probe.py``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", K3JAX_COMPILE_CACHE=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=os.pathsep.join(map(str, (ROOT, TESTS))))
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, "-m", "children.compile_cache_probe"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    fields = dict(item.split("=") for item in out.split())
    return {k: int(v) for k, v in fields.items()}


@pytest.mark.slow
def test_processes_share_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = [_probe(cache), _probe(cache)]  # two writers of the same entries at the same time
    for r in map(_result, first):  # (which one compiles and which one loads an entry is a race)
        assert r["hits"] + r["misses"] >= 2 and r["warnings"] == 0, r
    assert any(p.name.endswith("-cache") for p in cache.iterdir())
    # a later process loads it; beside it (started together: each process spends most of its time
    # importing JAX), one with the cache turned off, pointed at a directory of its own
    reader, off = _probe(cache), _probe(tmp_path / "unused", {"K3JAX_COMPILE_CACHE": "off"})
    r = _result(reader)
    assert r["hits"] >= 1 and r["misses"] == 0 and r["warnings"] == 0, r
    r = _result(off)
    assert r["hits"] == 0 and not (tmp_path / "unused").exists()
