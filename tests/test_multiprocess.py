"""train.py as a two-process job on one machine (2 x 2 fake CPU devices, JAX's CPU collectives over
gloo): ``jax.distributed.initialize`` from the environment, per-process data, a mesh spanning both
processes, checkpoints written by both, a resume, and the checkpoint read back by one process."""

import json
import pathlib
import subprocess
import sys

import pytest

from cpu_devices import free_port, subprocess_env, xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARGS = ["model.num_layers=2", "model.attn_res.block_size=1", "train.seq_len=32",
        "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=2", "mesh.data=2", "mesh.fsdp=2"]




def _two_processes(run_dir, steps: int, sample_tokens: int = 0) -> list[str]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = subprocess_env(XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
                             JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(rank))
        cmd = [sys.executable, str(ROOT / "train.py"), "--sample-tokens", str(sample_tokens), *ARGS,
               f"train.steps={steps}", f"run_dir={run_dir}"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {rank}:\n{out[-4000:]}"
    return outs


@pytest.mark.slow
def test_two_process_training_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    first = _two_processes(run, steps=3)
    assert "4 cpu device(s) (mesh {'data': 2, 'fsdp': 2}), 2 process(es)" in first[0]
    second = _two_processes(run, steps=5, sample_tokens=4)  # one sampling run: the decode step compiles
    assert all("resumed from" in out and "at step 3" in out for out in second)
    assert "--- sample" in second[0] and "--- sample" not in second[1]  # process 0 alone reports
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5]  # one writer: no line twice
    # Both processes' shards make one checkpoint that a single process reads back whole.
    proc = subprocess.run([sys.executable, "-m", "children.restore_whole", str(run / "checkpoints")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=subprocess_env())
    assert proc.returncode == 0 and "OK steps 5 2 2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
