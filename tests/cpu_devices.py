"""Run a script in a fresh Python process with ``n`` fake CPU devices (the device count must be set
before JAX starts, and the rest of the suite runs on one device). The script prints ``OK`` when its
checks pass; its output is returned (and shown on failure)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_on_cpu_devices(script: str, n: int = 8, timeout: int = 900) -> str:
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout
