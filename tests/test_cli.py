"""The command lines and what a user sees when something is wrong: one training process per run
directory (a live holder is named, a stale lock does not block), config errors as one line with exit
code 2, infer.py arguments checked before anything is loaded or compiled, and clear errors for a float
prompt and a truncated safetensors file. Nothing here compiles a model."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import infer  # noqa: E402
import train  # noqa: E402
from k3jax.training.run_lock import LOCK_FILE, RunLockedError, lock_run_dir  # noqa: E402


def _hold_lock(run_dir, *, orphan: bool = False) -> subprocess.Popen:
    """A process holding the run directory's lock; ``holder`` is the PID holding the flock
    (``orphan``: a forked child that inherited it; the recorded process exits at once)."""
    body = ("pid = os.fork()\nif pid: print(pid, flush=True); os._exit(0)\ntime.sleep(120)" if orphan else
            "print(os.getpid(), flush=True); time.sleep(120)")
    script = f"import os, time\nfrom k3jax.training.run_lock import lock_run_dir\nwith lock_run_dir({str(run_dir)!r}):\n" + \
        textwrap.indent(body, "    ")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    proc.holder = int(proc.stdout.readline())
    return proc


def test_a_second_run_on_a_locked_run_dir_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        (run / "keep").write_text("the running job's files")
        code = train.main(["--fresh", "--sample-tokens", "0", f"run_dir={run}"])
        err = capsys.readouterr().err
        assert code == 1, err
        assert f"in use by process {holder.holder} on " in err and "another run_dir" in err, err
        assert sorted(p.name for p in run.iterdir()) == sorted(["keep", LOCK_FILE])  # --fresh deleted nothing
    finally:
        holder.kill()
        holder.wait()
    with lock_run_dir(run):  # the OS released the killed holder's flock: not stale-blocked
        assert (run / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert (run / LOCK_FILE).read_text() == ""


def test_a_lock_recorded_by_a_dead_process_does_not_block(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(f"999999999 {os.uname().nodename} 2026-01-01T00:00:00\n")  # no flock held
    with lock_run_dir(run):
        with pytest.raises(RunLockedError, match=f"process {os.getpid()} "):  # one holder at a time
            with lock_run_dir(run):
                pass
    # A flock inherited by a forked child that outlived the recorded process: the record decides (its
    # PID is dead: stale).
    orphan = _hold_lock(run, orphan=True)
    orphan.wait()
    try:
        with lock_run_dir(run):
            assert (run / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    finally:
        os.kill(orphan.holder, signal.SIGKILL)


@pytest.mark.parametrize("args,message", [
    (["--config", "no_such_config"], "unknown config 'no_such_config'"),
    (["model.hiden_size=32"], "did you mean"),
    (["model.moe.top_k=many"], "expected an integer"),
])
def test_train_config_errors_are_one_line_with_exit_code_2(args, message, capsys):
    code = train.main(["--sample-tokens", "0", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--config", "no_such_config"], "unknown config 'no_such_config'"),
    (["--tokenizer", "no/such/tokenizer.json"],
     "--tokenizer: 'no/such/tokenizer.json' is neither 'byte' nor an existing path"),
])
def test_infer_rejects_bad_arguments_before_loading_anything(args, message, tmp_path, capsys):
    # The checkpoint does not exist: an argument error must come first, before any load or compile.
    with pytest.raises(SystemExit) as exit_:
        infer.main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "And", *args])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert message in err and out == "", (out, err)
    assert "Traceback" not in err


def test_generate_refuses_float_prompts_and_empty_continuations():
    from k3jax import create_model, generate, load_config

    model = create_model(load_config("tiny", ["model.num_layers=2"]).model)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(model, np.asarray([[1.7, 2.0]]), 4)  # would be truncated to tokens 1 and 2
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate(model, np.asarray([[1, 2]]), 0)


def test_truncated_safetensors_header_names_the_file(tmp_path):
    from k3jax.interop.safetensors_io import SafetensorsFile, TensorSpec, write_file

    whole = tmp_path / "model.safetensors"
    write_file(whole, [TensorSpec("w", (2, 3), np.float32, lambda: np.ones((2, 3), np.float32))])
    data = whole.read_bytes()
    for cut in (3, 8 + 10):  # inside the length prefix, inside the JSON header
        broken = tmp_path / f"cut{cut}.safetensors"
        broken.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{broken}: not a complete safetensors file.*ends inside its header"):
            SafetensorsFile(broken)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((20).to_bytes(8, "little") + b"{not json at all....")
    with pytest.raises(ValueError, match=rf"{garbage}: the safetensors header is not valid JSON"):
        SafetensorsFile(garbage)
    np.testing.assert_array_equal(SafetensorsFile(whole).get("w"), np.ones((2, 3), np.float32))


def test_importing_the_entry_points_starts_no_jax_backend():
    """``jax.distributed.initialize`` (multi-host ``train.py``) must run before any JAX computation: a JAX
    value made at import time anywhere in k3jax would start the backend first and break it."""
    script = ("import infer, train, k3jax.aot, k3jax.serving\nfrom jax._src import xla_bridge\n"
              "assert not xla_bridge.backends_are_initialized()")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
