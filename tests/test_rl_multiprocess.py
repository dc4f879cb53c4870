"""RL through ``train.py`` as a two-process job on one machine (2 x 2 fake CPU devices, gloo; as
tests/test_multiprocess.py for pre-training): every process samples, scores and checks the same rollout
(``k3jax/rl/trainer.py``), the batch and the scoring forward's outputs span both processes, process 0 alone
logs, both save and resume; the rewards are the one-process run's on the same mesh, and the losses,
gradient norms and entropies agree within float32 rounding (gloo's reductions may add in another order than
the in-process ones). And the check of the rollouts itself (``k3jax/rl/agreement.py``): processes whose
rewards differ both stop with an error naming both digests."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from cpu_devices import free_port, subprocess_env, xla_flags
from k3jax.rl.agreement import rollout_digest
from k3jax.training.run_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
# tiny_rl (a LoRA run) from a random tiny model instead of the chat fine-tune, with two-layer model, 8-byte
# replies and a reward a random byte model gets some of (tests/rl_rewards.py); the mesh spans 4 devices
RL_TINY = ["--config", "tiny_rl", "train.init_from=null", "model.num_layers=2", "model.attn_res.block_size=1",
           "train.seq_len=32", "train.batch_size=8", "train.checkpoint_every=2",
           "train.rl.prompt_pattern=null", "train.rl.eval_fraction=0", "train.rl.group_size=4",
           "train.rl.prompts_per_step=2", "train.rl.max_new_tokens=8", "train.rl.measure_mismatch=false",
           "train.rl.rewards=[rl_rewards:lowercase_fraction]", "mesh.data=2", "mesh.fsdp=2"]
WORDS = ["In", "And", "The", "For", "But", "Then", "So", "He"]
# GRPO's loss at ratio 1 is minus the mean advantage: 0 up to rounding (|loss| < 1e-7), hence the atol
COMPARED = ("loss", "grad_norm", "entropy")


def _start(cmd, processes: int, devices: int) -> list[subprocess.Popen]:
    """``cmd`` as a job of ``processes`` processes with ``devices`` fake CPU devices each."""
    port = free_port()
    procs = []
    for rank in range(processes):
        job = dict(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(processes),
                   JAX_PROCESS_ID=str(rank)) if processes > 1 else {}
        env = subprocess_env(XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
                             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **job)
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {rank}:\n{out[-4000:]}"
    return outs


def _rl(prompts, run_dir, steps: int, processes: int) -> list[subprocess.Popen]:
    cmd = [sys.executable, str(ROOT / "train.py"), *RL_TINY, f"train.rl.prompts={prompts}", f"train.steps={steps}",
           f"run_dir={run_dir}"]
    return _start(cmd, processes, devices=4 // processes)


@pytest.mark.slow
def test_two_process_rl_matches_one_process(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    two, one = tmp_path / "two", tmp_path / "one"
    first = _finish(_rl(prompts, two, steps=2, processes=2))
    assert "4 cpu device(s) (mesh {'data': 2, 'fsdp': 2}), 2 process(es)" in first[0]
    # the resume loads the first run's programs from the compilation cache: the one-process run beside it
    resumed = _rl(prompts, two, steps=3, processes=2)
    straight = _rl(prompts, one, steps=3, processes=1)
    second = _finish(resumed)
    _finish(straight)
    assert all("resumed from" in out and "at step 2" in out for out in second)
    assert "metrics in" in second[0] and "metrics in" not in second[1]  # process 0 alone reports
    records = [r for r in read_metrics(two) if "reward_mean" in r]
    assert [r["step"] for r in records] == [1, 2, 3]  # one writer: no line twice
    reference = [r for r in read_metrics(one) if "reward_mean" in r]
    print("two processes:", [(r["reward_mean"], r["loss"], r["grad_norm"]) for r in records])
    print("one process:  ", [(r["reward_mean"], r["loss"], r["grad_norm"]) for r in reference])
    for a, b in zip(records, reference):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"], a["step"]
        for key in COMPARED:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']} {key}")


@pytest.mark.slow
def test_processes_with_different_rollouts_stop_naming_both_digests():
    outs = _finish(_start([sys.executable, "-m", "children.rollout_agreement"], processes=2, devices=1))
    tokens, logprobs = np.arange(12, dtype=np.int32).reshape(3, 4), np.full((3, 4), -0.5, np.float32)
    digests = [rollout_digest(tokens, logprobs, np.array([0.5, 1.0, float(rank)])) for rank in range(2)]
    for rank, out in enumerate(outs):
        assert "OK" in out, out[-3000:]
        assert (f"step 2: the processes' rollouts differ: process 1's digest is {digests[1]}, process 0's "
                f"{digests[0]} (this is process {rank})") in out, out[-3000:]


@pytest.mark.slow
def test_process_zeros_tool_turns_and_rewards_reach_every_process():
    """What process 0 alone computes (an RL run's environment answers and rewards) reaches every process, and its
    exceptions stop every process (``distributed.main_process_result``)."""
    for rank, out in enumerate(_finish(_start([sys.executable, "-m", "children.main_process_result"], processes=2,
                                              devices=1))):
        assert out.rstrip().endswith("OK"), f"process {rank}:\n{out[-3000:]}"
