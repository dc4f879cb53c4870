"""train.py on a device mesh: a run checkpointed on one device resumes on an 8-device data x expert x
sequence mesh (fake CPU devices) and continues with the losses the single-device run has; the same
checkpoint restores for inference onto yet another mesh with every array in its new sharding. The
same seed gives the same initial model on 1 and on 8 devices, bit for bit (with the resumed run's
losses, that makes a fresh 8-device run take the 1-device run's steps; it is not run a third time)."""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cpu_devices import xla_flags
from test_train import SMALL, train_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 4
MESH = ["mesh.data=2", "mesh.expert=2", "mesh.sequence=2"]


def _train(run_dir, env, *extra):
    cmd = [sys.executable, str(ROOT / "train.py"), "--sample-tokens", "0", *SMALL, "train.batch_size=8",
           "train.checkpoint_every=2", f"train.steps={STEPS}", f"run_dir={run_dir}", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(run_dir) -> dict[int, dict]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow
def test_resume_on_another_mesh_continues_the_run(tmp_path):
    env = train_env()
    straight = tmp_path / "straight"
    _train(straight, env)

    # The same run rolled back to its step-2 checkpoint (the newer one deleted) and resumed on 8 devices
    # (2 data x 2 expert x 2 sequence): the metrics of steps 3 and 4 are dropped, then logged again.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))
    eight = dict(env, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"))
    out = _train(resumed, eight, *MESH)
    assert "8 cpu device(s) (mesh {'data': 2, 'expert': 2, 'sequence': 2})" in out, out
    assert "resumed from" in out and "at step 2" in out, out
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4], steps  # four losses and the final eval, each once

    want, got = _losses(straight), _losses(resumed)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in (3, 4):  # float32; only the reduction order differs between the meshes
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(got[step][key], want[step][key], rtol=2e-5, err_msg=f"step {step} {key}")

    # Inference: restore the 8-device run's last checkpoint onto a 4-device fsdp x expert mesh.
    proc = subprocess.run([sys.executable, "-m", "children.restore_on_mesh", str(resumed / "checkpoints")],
                          capture_output=True, text=True, timeout=600, env=eight, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_same_seed_same_initial_state_on_one_and_eight_devices(tmp_path):
    env = dict(train_env(), XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"))
    proc = subprocess.run([sys.executable, "-m", "children.init_on_two_meshes", *SMALL, "train.batch_size=8"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
