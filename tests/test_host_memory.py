"""k3jax/runtime/host_memory.py: with ``K3JAX_HOST_MEMORY=keep``, importing k3jax makes glibc keep freed memory,
so jitted calls reuse the pages of earlier calls' temporaries instead of faulting them in afresh.
Each case runs in a fresh process: the setting must come before ``import jax`` starts its threads."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from k3jax.runtime import host_memory

# A jitted function whose temporaries are one 128 MiB block (XLA:CPU allocates them per call); the
# child reports the minor page faults of each of its calls.
CHILD = """
import json, resource
import k3jax
from k3jax.runtime import host_memory
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.sin(x)[::-1] * 2.0))  # a temporary the size of x
x = jnp.ones((32 << 20,), jnp.float32)
faults = []
for _ in range(CALLS):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "keeps": host_memory.keeps_host_memory()}))
"""
BLOCK_PAGES = (128 << 20) // 4096
CALLS = 12


def _calls(choice: str) -> dict:
    # One CPU device, whatever the test process's environment says (with several, XLA:CPU's blocks fault
    # in afresh either way: k3jax/runtime/host_memory.py)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent), host_memory.ENV_VAR: choice}
    out = subprocess.run([sys.executable, "-c", CHILD.replace("CALLS", str(CALLS))], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_importing_k3jax_keeps_freed_memory_for_the_next_calls():
    """With glibc's defaults every call faults its block in again; kept, later calls reuse the pages,
    most of them (3 to 11 of 11 in runs here: a small block left above a freed large one can make the
    next large block come from fresh memory), so the test asks for one."""
    glibc = _calls(host_memory.GLIBC)
    assert not glibc["keeps"] and all(f > BLOCK_PAGES // 2 for f in glibc["faults"][1:]), glibc
    kept = _calls(host_memory.KEEP)
    assert kept["keeps"] and any(f < BLOCK_PAGES // 50 for f in kept["faults"][1:]), kept


def test_keep_false_restores_the_defaults_and_bad_choices_are_refused(monkeypatch):
    was = host_memory.keeps_host_memory()
    try:
        assert host_memory.keep_host_memory() and host_memory.keeps_host_memory()
        assert host_memory.keep_host_memory(False) and not host_memory.keeps_host_memory()
        monkeypatch.setenv(host_memory.ENV_VAR, host_memory.GLIBC)
        assert not host_memory.apply_default() and not host_memory.keeps_host_memory()
        monkeypatch.delenv(host_memory.ENV_VAR)  # opt-in: glibc's defaults unless asked
        assert not host_memory.apply_default() and not host_memory.keeps_host_memory()
        monkeypatch.setenv(host_memory.ENV_VAR, "tcmalloc")
        with pytest.raises(ValueError, match="K3JAX_HOST_MEMORY"):
            host_memory.apply_default()
    finally:
        host_memory.keep_host_memory(was)
