"""A run as a pod job meets its faults: SIGTERM (a preempted spot VM, a Kubernetes eviction) during a step and
during an asynchronous save, on one process and on two; a checkpoint save that fails (ENOSPC in orbax's
writer); bad data records under both policies; a run of non-finite steps (stop, or roll back once per
checkpoint). gs:// paths: tests/test_gcs.py."""

import errno
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cpu_devices import free_port, subprocess_env, xla_flags
from test_train import STEPS, logged_steps, train_cmd, train_env  # train.py runs: test_train's two-layer tiny
from k3jax.training import checkpoint
from k3jax.config import load_config
from k3jax.data.chat import ConversationToPieces, open_conversations, scan_conversations
from k3jax.data.pipeline import make_train_dataset
from k3jax.data.sources import BadRecordError, GuardedRecords, open_documents
from k3jax.tokenizer import load_tokenizer
from k3jax.training.run_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
# In-process runs: a one-layer tiny on short rows (the program test_train_without_eval compiles too).
ONE_LAYER = ["model.num_layers=1", "train.seq_len=16", "train.batch_size=2", "train.log_every=1",
             "train.data.eval_fraction=0", "train.checkpoint_every=2"]


def _train(tmp_path, name, *overrides, **kw):
    from k3jax.training.trainer import train

    return train(load_config("tiny", ONE_LAYER + [f"train.out_dir={tmp_path / name}", *overrides]), sample_tokens=0,
                 **kw)


def _losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r]


# --- a failed save ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_a_failed_save_stops_the_run_keeps_the_previous_checkpoint_and_resumes(tmp_path, monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    from k3jax.training.trainer import train  # noqa: F401 (imported before the writer is patched)

    straight = _train(tmp_path, "straight", "train.steps=6")
    writer = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def disk_full_at_step_4(self, x, directory):
        if "/checkpoints/4." in str(directory):  # orbax writes <step>.orbax-checkpoint-tmp, then renames it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return await writer(self, x, directory)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full_at_step_4)
    with pytest.raises(checkpoint.CheckpointSaveError) as failed:
        _train(tmp_path, "run", "train.steps=6")
    message = str(failed.value)
    assert f"saving checkpoint {tmp_path / 'run' / 'checkpoints'}/4 failed" in message
    assert "No space left on device" in message and "step 2, is intact" in message
    ckpts = tmp_path / "run" / "checkpoints"
    assert checkpoint.manager(ckpts).all_steps() == [2]  # the partial step 4 is not listed
    assert checkpoint.latest_step(ckpts) == 2

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", writer)  # space freed
    resumed = _train(tmp_path, "run", "train.steps=6")
    assert resumed["loss"] == straight["loss"]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "straight")
    assert checkpoint.manager(ckpts).all_steps() == [2, 4, 6]


# --- non-finite steps ---------------------------------------------------------------------------------

def _nonfinite_calls(monkeypatch, bad_calls: set[int]):
    """The train step, except that calls ``bad_calls`` (1-based) behave as the NaN guard does on a
    non-finite loss: the state unchanged, ``finite`` False."""
    import jax

    from k3jax.training import trainer

    real_make = trainer.make_train_step
    calls = {"n": 0, "metrics": None}

    def make(*args, **kwargs):
        step = real_make(*args, **kwargs)

        def maybe_bad(state, batch):
            calls["n"] += 1
            if calls["n"] not in bad_calls:
                state, calls["metrics"] = step(state, batch)
                return state, calls["metrics"]
            nan = jax.tree.map(lambda x: np.full(np.shape(x), np.nan, np.float32), calls["metrics"])
            return state, {**nan, "tokens": calls["metrics"]["tokens"], "finite": np.asarray(False)}

        return maybe_bad

    monkeypatch.setattr(trainer, "make_train_step", make)
    return calls


@pytest.mark.usefixtures("fast_xla_test")
def test_consecutive_nonfinite_steps_stop_the_run(tmp_path, monkeypatch):
    from k3jax.training.trainer import DivergenceError

    _nonfinite_calls(monkeypatch, {3, 5, 6, 7})  # step 3 alone is within the bound
    with pytest.raises(DivergenceError, match=r"steps 5-7: 3 consecutive updates skipped .*max_nonfinite_steps=3\)"
                                              r"\. The latest checkpoint is step 6"):
        _train(tmp_path, "run", "train.steps=10", "train.max_nonfinite_steps=3")
    logged = _losses(tmp_path / "run")
    assert [s for s, _, _ in logged] == [1, 2, 3, 4, 5, 6]  # the run stopped at step 7, before logging it
    assert [math.isnan(loss) for _, loss, _ in logged] == [False, False, True, False, True, True]


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_nonfinite_steps_roll_back_once_per_checkpoint(tmp_path, monkeypatch, capsys):
    from k3jax.training.trainer import DivergenceError

    straight = tmp_path / "straight"
    _train(tmp_path, "straight", "train.steps=6")
    _nonfinite_calls(monkeypatch, {5, 6})  # steps 5 and 6 diverge: back to checkpoint 4, then on
    result = _train(tmp_path, "run", "train.steps=6", "train.max_nonfinite_steps=2", "train.on_nonfinite=rollback")
    assert not result["interrupted"] and math.isfinite(result["loss"])
    assert "steps 5-6: 2 consecutive updates skipped" in capsys.readouterr().out
    steps = [s for s, _, _ in _losses(tmp_path / "run")]
    assert steps == [1, 2, 3, 4, 5, 6]  # the abandoned records of the diverged steps are gone
    # steps 1-4 as the straight run; after the rollback the run trains on the batches after the bad ones
    assert _losses(tmp_path / "run")[:4] == _losses(straight)[:4]
    assert _losses(tmp_path / "run")[4:] != _losses(straight)[4:]

    _nonfinite_calls(monkeypatch, {5, 6, 7, 8})  # diverges again after the rollback: stop
    with pytest.raises(DivergenceError, match="already rolled back to checkpoint 4 once"):
        _train(tmp_path, "again", "train.steps=8", "train.max_nonfinite_steps=2", "train.on_nonfinite=rollback")


def test_nonfinite_bound_config():
    assert load_config("tiny").train.max_nonfinite_steps == 20 and load_config("tiny").train.on_nonfinite == "stop"
    with pytest.raises(ValueError, match="max_nonfinite_steps"):
        load_config("tiny", ["train.max_nonfinite_steps=-1"])
    with pytest.raises(ValueError, match="on_nonfinite"):
        load_config("tiny", ["train.on_nonfinite=ignore"])


# --- bad records --------------------------------------------------------------------------------------

GOOD = [f"Let there be light {i}." for i in range(6)]  # short: a run's few steps read them all
# (kind, raw JSONL line, what the error says)
BAD_LINES = [
    ("undecodable", b'{"text": "unterminated', r"record 1 \(line 2\): not valid JSON"),
    ("not UTF-8", b'{"text": "caf\xe9"}', r"record 3 \(line 4\): not valid UTF-8"),
    ("wrong type", b'{"text": 7}', r"record 5 \(line 6\): field 'text' is int, not a string"),
    ("empty", b'{"text": "  "}', r"record 7 \(line 8\): empty document"),
]


def _bad_jsonl(path: pathlib.Path) -> pathlib.Path:
    lines = []
    for i, good in enumerate(GOOD):
        lines.append(json.dumps({"text": good}).encode())
        if i < len(BAD_LINES):
            lines.append(BAD_LINES[i][1])
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("kind,line,error", BAD_LINES, ids=[k for k, _, _ in BAD_LINES])
def test_each_bad_record_stops_naming_file_and_record_or_is_skipped(tmp_path, kind, line, error):
    path = _bad_jsonl(tmp_path / "docs.jsonl")
    index = int(error.split("record ")[1].split(" ")[0])
    stop = GuardedRecords(open_documents(str(path), bad_records="skip"), "stop")
    with pytest.raises(BadRecordError, match=f"{path}: {error}"):
        stop[index]
    skip = GuardedRecords(open_documents(str(path), bad_records="skip"), "skip")
    assert skip[index] is None and skip.skipped.count == 1 and str(path) in skip.skipped.last
    assert skip[index - 1] == GOOD[index // 2]  # the good ones read as before


def test_parquet_bad_records(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["fine", None, ""]}), tmp_path / "d.parquet")
    docs = GuardedRecords(open_documents(str(tmp_path / "d.parquet")), "skip")
    assert [docs[i] for i in range(3)] == ["fine", None, None] and docs.skipped.count == 2
    with pytest.raises(BadRecordError, match=r"d.parquet: record 1 \(row 1\): column 'text' is NoneType"):
        GuardedRecords(open_documents(str(tmp_path / "d.parquet")), "stop")[1]


def test_a_source_of_only_bad_records_stops_under_skip(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": 1}\n{"text": ""}\n')
    cfg = load_config("tiny", [f"train.data.source={path}", "train.data.bad_records=skip", "train.seq_len=16",
                               "train.batch_size=2", "train.data.eval_fraction=0"])
    with pytest.raises(BadRecordError, match="every record of the source is bad"):
        next(iter(make_train_dataset(cfg.train)))


def test_the_pipeline_skips_and_counts_or_stops(tmp_path):
    path = _bad_jsonl(tmp_path / "docs.jsonl")
    common = [f"train.data.source={path}", "train.seq_len=16", "train.batch_size=2", "train.data.eval_fraction=0",
              "train.data.shuffle=false"]
    ds = make_train_dataset(load_config("tiny", common + ["train.data.bad_records=skip"]).train)
    it = iter(ds)
    while ds.bad_records.count < len(BAD_LINES):  # an epoch: every bad record met once
        batch = next(it)
        assert batch["tokens"].shape == (2, 16)
    with pytest.raises(BadRecordError, match=f"{path}: record 1 \\(line 2\\): not valid JSON"):
        for _ in make_train_dataset(load_config("tiny", common).train):
            pass
    # the default opens the file checking its first record; skip leaves it to the pipeline
    path.write_bytes(b'{"text": 7}\n' + json.dumps({"text": GOOD[0]}).encode() + b"\n")
    with pytest.raises(BadRecordError, match="record 0"):
        open_documents(str(path))
    assert len(open_documents(str(path), bad_records="skip")) == 2


def test_chat_records_under_both_policies(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, {"messages": [{"role": "robot", "content": "x"}]}, good,
                                                      {"messages": "not a list"}]) + "\n")
    to_pieces = ConversationToPieces(load_tokenizer("byte"), 64, "assistant", "truncate")
    counts = scan_conversations(GuardedRecords(open_conversations(str(path)), "skip"), to_pieces)
    assert (counts.kept, counts.bad, counts.conversations) == (2, 2, 4)
    assert "2 invalid skipped" in counts.summary()
    with pytest.raises(BadRecordError, match=r"chat.jsonl: record 1 \(line 2\): messages\[0\]\.role: unknown role"):
        scan_conversations(GuardedRecords(open_conversations(str(path)), "stop"), to_pieces)
    cfg = load_config("tiny", [f"train.data.source={path}", "train.data.format=chat", "train.seq_len=64",
                               "train.batch_size=2", "train.data.eval_fraction=0", "train.data.bad_records=skip",
                               "train.data.shuffle=false"])  # a shuffle window would read 500 epochs of 4 records
    ds = make_train_dataset(cfg.train)
    it = iter(ds)
    while ds.bad_records.count < 2:
        next(it)
    assert "not a list" in ds.bad_records.last or "unknown role" in ds.bad_records.last


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_a_run_counts_skipped_records_in_its_metrics_or_stops(tmp_path, capsys):
    import train as train_cli

    path = _bad_jsonl(tmp_path / "docs.jsonl")
    data = [f"train.data.source={path}", "train.data.shuffle=false"]
    _train(tmp_path, "skip", "train.steps=6", "train.data.bad_records=skip", *data)
    skipped = [r["skipped_records"] for r in read_metrics(tmp_path / "skip") if "loss" in r]
    assert len(skipped) == 6 and sum(skipped) >= len(BAD_LINES)  # an epoch or more, every bad record counted

    code = train_cli.main(["--config", "tiny", "--sample-tokens", "0", *ONE_LAYER, "train.steps=6", *data,
                           f"run_dir={tmp_path / 'stop'}"])
    err = capsys.readouterr().err
    assert code == train_cli.EXIT_FAULT == 3, err
    assert f"error: {path}: record 1 (line 2): not valid JSON" in err
    # the fix: resume the same run skipping bad records (bad_records may change on resume)
    assert train_cli.main(["--config", "tiny", "--sample-tokens", "0", *ONE_LAYER, "train.steps=6", *data,
                           "train.data.bad_records=skip", f"run_dir={tmp_path / 'stop'}"]) == 0


# --- SIGTERM ------------------------------------------------------------------------------------------


def _signal_when(proc, run_dir, step: int, sig=signal.SIGTERM, in_flight_save: bool = False) -> str:
    """Send ``sig`` to ``proc`` once ``run_dir`` has logged ``step`` (and, with ``in_flight_save``, while a
    checkpoint is still being written); its output."""
    deadline = time.time() + 900
    while logged_steps(run_dir) < step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if in_flight_save:  # the step's checkpoint is still being written (orbax's temporary directory)
        tmp = pathlib.Path(run_dir) / "checkpoints"
        while not any(".orbax-checkpoint-tmp" in p.name for p in tmp.glob("*")) and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.005)
    proc.send_signal(sig)
    return proc.communicate(timeout=600)[0].decode()


@pytest.mark.slow
def test_sigterm_during_an_async_save_and_ctrl_c_during_a_step_then_resume(tmp_path):
    """A train.py run stopped twice, by SIGTERM (a preempted VM) while its checkpoint is being written and
    by Ctrl-C during a step of the resumed run, each time saving the step it stopped at, then finished by the
    same command, logs every value of the uninterrupted run bit for bit."""
    env = train_env()
    straight, run = tmp_path / "straight", tmp_path / "run"
    subprocess.run(train_cmd(straight), env=env, check=True, capture_output=True, timeout=900)

    # 1. SIGTERM during the asynchronous save of checkpoint 4
    proc = subprocess.Popen(train_cmd(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = _signal_when(proc, run, 4, in_flight_save=True)
    assert proc.returncode == 143, out
    first = logged_steps(run)
    assert 4 <= first < STEPS and f"SIGTERM: stopped at step {first}" in out, out
    assert checkpoint.latest_step(run / "checkpoints") == first  # saved at the next step boundary
    # 2. Ctrl-C during a step of the resumed run
    proc = subprocess.Popen(train_cmd(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = _signal_when(proc, run, first + 2, signal.SIGINT)
    assert proc.returncode == 130 and f"resumed from {run / 'checkpoints'} at step {first}" in out, out
    second = logged_steps(run)
    assert first < second < STEPS and checkpoint.latest_step(run / "checkpoints") == second, out
    # 3. the same command finishes; every logged value is the uninterrupted run's
    done = subprocess.run(train_cmd(run), env=env, check=True, capture_output=True, timeout=900)
    assert f"resumed from {run / 'checkpoints'} at step {second}" in (done.stdout + done.stderr).decode()
    want, got = read_metrics(straight), read_metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "lr", "expert_imbalance", "eval_loss"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    losses = [r["loss"] for r in want if "loss" in r]
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    assert (run / "loss.png").stat().st_size > 0 and any((run / "tensorboard").iterdir())


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path):
    from test_multiprocess import ARGS

    run = tmp_path / "run"

    def start(steps):
        port, procs = free_port(), []
        for rank in range(2):
            env = subprocess_env(XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
                                 JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                                 JAX_PROCESS_ID=str(rank))
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--sample-tokens", "0", *ARGS,
                                           "train.checkpoint_every=100", f"train.steps={steps}", f"run_dir={run}"],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        return procs

    procs = start(8)
    deadline = time.time() + 900
    while logged_steps(run) < 2 and all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)  # one host preempted: both must stop at the same step
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [143, 143], outs[0][-3000:] + outs[1][-3000:]
    stopped = logged_steps(run)
    assert 2 <= stopped < 8 and checkpoint.manager(run / "checkpoints").all_steps() == [stopped]
    procs = start(8)
    outs = [p.communicate(timeout=900)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert all(f"at step {stopped}" in out for out in outs)
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 9))
