"""k3jax/host_memory.py: importing k3jax makes glibc keep freed memory, so a jitted call reuses the pages
of the last call's temporaries instead of faulting them in afresh; ``K3JAX_HOST_MEMORY=glibc`` opts out.
Each case runs in a fresh process: the setting must come before ``import jax`` starts its threads."""

import json
import os
import subprocess
import sys

import pytest

from k3jax import host_memory

# A jitted function whose temporaries are one 128 MiB block (XLA:CPU allocates them per call); the
# child reports the minor page faults of its third call.
CHILD = """
import json, resource
import k3jax
from k3jax import host_memory
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.sin(x)[::-1] * 2.0))  # a temporary the size of x
x = jnp.ones((32 << 20,), jnp.float32)
for _ in range(2):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
f(x).block_until_ready()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "keeps": host_memory.keeps_host_memory()}))
"""
BLOCK_PAGES = (128 << 20) // 4096


def _third_call(choice: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", host_memory.ENV_VAR: choice}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_importing_k3jax_keeps_freed_memory_for_the_next_call():
    glibc = _third_call(host_memory.GLIBC)
    assert not glibc["keeps"] and glibc["faults"] > BLOCK_PAGES // 2, glibc  # faulted in again
    kept = _third_call(host_memory.KEEP)
    assert kept["keeps"] and kept["faults"] < BLOCK_PAGES // 50, kept  # the last call's pages


def test_keep_false_restores_the_defaults_and_bad_choices_are_refused(monkeypatch):
    was = host_memory.keeps_host_memory()
    try:
        assert host_memory.keep_host_memory() and host_memory.keeps_host_memory()
        assert host_memory.keep_host_memory(False) and not host_memory.keeps_host_memory()
        monkeypatch.setenv(host_memory.ENV_VAR, host_memory.GLIBC)
        assert not host_memory.apply_default() and not host_memory.keeps_host_memory()
        monkeypatch.setenv(host_memory.ENV_VAR, "tcmalloc")
        with pytest.raises(ValueError, match="K3JAX_HOST_MEMORY"):
            host_memory.apply_default()
    finally:
        host_memory.keep_host_memory(was)
