"""k3jax/runtime/host_memory.py: with ``K3JAX_HOST_MEMORY=keep``, importing k3jax makes glibc keep freed memory,
so jitted calls reuse the pages of earlier calls' temporaries instead of faulting them in afresh.
Each case runs in a fresh process: the setting must come before ``import jax`` starts its threads."""

import json
import os
import subprocess
import sys

import pytest

from cpu_devices import ROOT, TESTS
from k3jax.runtime import host_memory

# the child's jitted function: one 128 MiB temporary per call (tests/children/page_faults.py)
BLOCK_PAGES = (128 << 20) // 4096
CALLS = 12


def _calls(choice: str) -> dict:
    # One CPU device, whatever the test process's environment says (with several, XLA:CPU's blocks fault
    # in afresh either way: k3jax/runtime/host_memory.py)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(map(str, (ROOT, TESTS))), host_memory.ENV_VAR: choice}
    out = subprocess.run([sys.executable, "-m", "children.page_faults", str(CALLS)], env=env, capture_output=True,
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
