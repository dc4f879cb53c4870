"""gs:// paths against a GCS emulator started by the test (tests/gcs_emulator.py): k3jax.runtime.storage's rule, the
run lock as a generation-checked lease, data read from a bucket (and a file removed mid-run), and the main
job's run in a bucket: trained, stopped by SIGTERM, resumed to an uninterrupted run's losses bit for bit,
read back by infer.py and the server's loader, with nothing written to the local disk but caches."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from cpu_devices import subprocess_env
from test_train import SMALL
from gcs_emulator import BUCKET, gcs_emulator
from k3jax.runtime import compile_cache, storage
from k3jax.training import run_lock
from k3jax.data.sources import BadRecordError, GuardedRecords, JsonlDocuments, open_documents

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 8  # of test_train's SMALL: the main job's config (tiny K3), two layers on short rows, checkpointed every 4


@pytest.fixture(scope="module")
def gcs():
    with gcs_emulator() as env:
        import fsspec

        yield env, fsspec.filesystem("gcs")


def _docs(n: int) -> list[str]:
    text = storage.read_text(ROOT / "k3jax" / "data" / "corpus" / "kjv.txt")
    return [d for d in text.split("\n\n") if d.strip()][:n]


def test_local_paths_stay_pathlib(tmp_path):
    assert storage.path(tmp_path / "a") == pathlib.Path(tmp_path / "a")
    assert isinstance(storage.path(str(tmp_path)), pathlib.Path)
    assert storage.path(f"file://{tmp_path}") == tmp_path
    assert not storage.is_remote(tmp_path) and storage.is_remote("gs://b/x") and storage.scheme("s3://b") == "s3"
    storage.write_text(tmp_path / "f.txt", "one")
    storage.write_text(tmp_path / "f.txt", "two")  # replaced whole, no temporary left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]
    assert storage.read_range(tmp_path / "f.txt", 1, 2) == b"wo"
    assert storage.local_copy(tmp_path / "f.txt") == tmp_path / "f.txt"


def test_storage_on_a_bucket(gcs, tmp_path, monkeypatch):
    _, fs = gcs
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    root = f"gs://{BUCKET}/storage"
    storage.write_text(f"{root}/a/x.jsonl", "0123456789")
    storage.write_bytes(f"{root}/a/y.txt", b"y")
    assert storage.exists(f"{root}/a/x.jsonl") and storage.path(f"{root}/a").is_dir() and not storage.exists(f"{root}/zz")
    assert [p.name for p in storage.glob(f"{root}/a/*.jsonl")] == ["x.jsonl"]
    assert str(storage.glob(f"{root}/*/y.txt")[0]) == f"{root}/a/y.txt"
    assert storage.read_range(f"{root}/a/x.jsonl", 3, 4) == b"3456"
    log = storage.open_for_append(f"{root}/log.jsonl")
    log.write("1\n")
    log.flush()
    assert storage.read_text(f"{root}/log.jsonl") == "1\n"
    log.write("2\n")
    log.close()
    again = storage.open_for_append(f"{root}/log.jsonl")  # an append continues the object
    again.write("3\n")
    again.close()
    assert storage.read_text(f"{root}/log.jsonl") == "1\n2\n3\n"
    local = storage.local_copy(f"{root}/a")
    assert local.is_relative_to(tmp_path / "cache") and (local / "x.jsonl").read_text() == "0123456789"
    with storage.staged_upload(f"{root}/up") as d:
        (d / "sub").mkdir()
        (d / "sub" / "f.bin").write_bytes(b"abc")
    assert storage.read_bytes(f"{root}/up/sub/f.bin") == b"abc"
    storage.rmtree(f"{root}/up")
    assert not storage.exists(f"{root}/up/sub/f.bin")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_on_a_bucket_is_a_generation_checked_lease(gcs):
    _, fs = gcs
    run = f"gs://{BUCKET}/locked"
    url = f"{run}/{run_lock.LOCK_FILE}"
    with run_lock.lock_run_dir(run):
        fs.invalidate_cache()
        assert fs.cat_file(url).decode().split()[:2] == [str(os.getpid()), socket.gethostname()]
        with pytest.raises(run_lock.RunLockedError, match=f"in use by process {os.getpid()} on"):
            with run_lock.lock_run_dir(run):
                pass
        # the lock's object only changes under a matching generation: a stale writer gets HTTP 412
        obj = run_lock._GcsObject(url)
        with pytest.raises(FileExistsError):
            obj.write(b"intruder", 0)
        with pytest.raises(FileExistsError):
            obj.write(b"intruder", obj.read()[1] + 1)
    fs.invalidate_cache()
    assert not fs.exists(url)  # released
    # a holder that died without releasing: its PID is dead on this host, so the lease is taken over
    fs.pipe_file(url, f"{_dead_pid()} {socket.gethostname()} 2026-01-01T00:00:00\n".encode())
    with run_lock.lock_run_dir(run):
        fs.invalidate_cache()
        assert fs.cat_file(url).decode().startswith(f"{os.getpid()} ")
    # another host's holder, renewed moments ago: live, whatever its PID
    fs.pipe_file(url, b"1 elsewhere 2026-01-01T00:00:00\n")
    with pytest.raises(run_lock.RunLockedError, match="process 1 on elsewhere"):
        with run_lock.lock_run_dir(run):
            pass


def test_run_lock_lease_expires_and_is_renewed(gcs, monkeypatch):
    _, fs = gcs
    run = f"gs://{BUCKET}/lease"
    url = f"{run}/{run_lock.LOCK_FILE}"
    monkeypatch.setattr(run_lock, "LEASE_S", 0.6)
    fs.pipe_file(url, b"1 elsewhere 2026-01-01T00:00:00\n")
    time.sleep(0.8)  # not renewed for longer than the lease: stale
    with run_lock.lock_run_dir(run):
        first = run_lock._GcsObject(url).read()[1]
        time.sleep(0.7)  # the holder renews every LEASE_S / 3
        assert run_lock._GcsObject(url).read()[1] != first
        with pytest.raises(run_lock.RunLockedError):
            with run_lock.lock_run_dir(run):
                pass


def test_jsonl_from_a_bucket_and_a_file_removed_mid_run(gcs):
    _, fs = gcs
    url = f"gs://{BUCKET}/data/docs.jsonl"
    fs.pipe_file(url, "\n".join(json.dumps({"text": d}) for d in _docs(5)).encode())
    docs = open_documents(url)
    assert isinstance(docs, JsonlDocuments) and len(docs) == 5 and docs[3] == _docs(5)[3]
    assert len(open_documents(f"gs://{BUCKET}/data/*.jsonl")) == 5
    fs.rm(url)
    with pytest.raises(BadRecordError, match=r"docs.jsonl: record 2 \(line 3\): cannot be read .*FileNotFoundError"):
        GuardedRecords(docs, "stop")[2]
    skipping = GuardedRecords(docs, "skip")
    assert skipping[2] is None and skipping[4] is None and skipping.skipped.count == 2
    with pytest.raises(BadRecordError, match="every record of the source is bad"):
        [skipping[i] for i in range(5)]


def _losses(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def _bucket_metrics(fs, run: str) -> list[dict]:
    fs.invalidate_cache()
    path = f"{BUCKET}/{run}/metrics.jsonl"
    if not fs.exists(path):
        return []
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line.strip()]


@pytest.mark.slow
def test_main_job_in_a_bucket_stops_on_sigterm_resumes_and_serves(gcs, tmp_path):
    env_vars, fs = gcs
    fs.pipe_file(f"{BUCKET}/data/bible.jsonl", "\n".join(json.dumps({"text": d}) for d in _docs(40)).encode())
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    # caches: the compiled programs (shared with the rest of the suite, elsewhere), the storage cache, temp files
    env = subprocess_env(**env_vars, XDG_CACHE_HOME=str(cache), HOME=str(tmp_path / "home"), TMPDIR=str(cache / "tmp"),
                         K3JAX_COMPILE_CACHE=str(compile_cache.resolve() or "off"),
                         MPLCONFIGDIR=str(cache / "matplotlib"))  # matplotlib's font cache (else under ~/.config)
    (cache / "tmp").mkdir(parents=True)

    def cmd(run):
        return [sys.executable, str(ROOT / "train.py"), "--sample-tokens", "0", *SMALL, f"train.steps={STEPS}",
                f"run_dir=gs://{BUCKET}/{run}", f"train.data.source=gs://{BUCKET}/data/*.jsonl"]

    straight = subprocess.run(cmd("straight"), env=env, cwd=work, capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]

    proc = subprocess.Popen(cmd("run"), env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 900
    while len(_losses(_bucket_metrics(fs, "run"))) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # a preempted VM: finish the step, save, exit 143
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 143, out[-3000:]
    stopped_at = max(step for step, _, _ in _losses(_bucket_metrics(fs, "run")))
    assert 3 <= stopped_at < STEPS and "SIGTERM: stopped at step" in out, out[-3000:]
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/run/checkpoints/{stopped_at}/commit_success.txt")
    assert not fs.exists(f"{BUCKET}/run/{run_lock.LOCK_FILE}")  # released on the way out

    resumed = subprocess.run(cmd("run"), env=env, cwd=work, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from gs://{BUCKET}/run/checkpoints at step {stopped_at}" in resumed.stdout + resumed.stderr
    want, got = _losses(_bucket_metrics(fs, "straight")), _losses(_bucket_metrics(fs, "run"))
    assert len(want) == STEPS and got == want  # bit for bit
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/run/loss.png") and fs.find(f"{BUCKET}/run/tensorboard")

    infer = subprocess.run([sys.executable, str(ROOT / "infer.py"), "--checkpoint", f"gs://{BUCKET}/run",
                            "--prompt", "And", "--max-new-tokens", "4", "--temperature", "0"],
                           env=env, cwd=work, capture_output=True, text=True, timeout=600)
    assert infer.returncode == 0 and infer.stdout.startswith("And"), infer.stdout[-2000:] + infer.stderr[-3000:]

    from k3jax.serving.loading import load_checkpoint_tokenizer, load_model

    model, cfg = load_model(f"gs://{BUCKET}/run")
    assert cfg.train.steps == STEPS and load_checkpoint_tokenizer(f"gs://{BUCKET}/run", cfg).vocab_size <= 256
    logits, _ = model(np.asarray([[65, 110, 100]], np.int32))
    assert np.isfinite(np.asarray(logits)).all()

    # nothing on the local disk but caches: the working directory is empty, the rest is under the cache
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "work"]


def test_checkpoints_and_hf_directories_in_a_bucket(gcs, tmp_path, monkeypatch):
    """save / restore_model, to_hf / from_hf and k3jax.convert between URLs: the same weights back."""
    import jax
    from flax import nnx

    from k3jax import convert, create_model
    from k3jax.training import checkpoint
    from k3jax.config import load_config
    from k3jax.interop import from_hf, to_hf

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    cfg = load_config("tiny", ["model.num_layers=1"])
    model = create_model(cfg.model, seed=3)
    want = jax.tree.leaves(nnx.state(model, nnx.Param))

    def same(other):
        got = jax.tree.leaves(nnx.state(other, nnx.Param))
        return len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(want, got))

    checkpoint.save_model(f"gs://{BUCKET}/ckpt", model, cfg, step=5)
    assert checkpoint.latest_step(f"gs://{BUCKET}/ckpt") == 5
    assert same(checkpoint.restore_model(f"gs://{BUCKET}/ckpt")[0])
    to_hf(model, f"gs://{BUCKET}/hf", model_type="kimi_k3", max_shard_size="200KB")
    assert len(storage.glob(f"gs://{BUCKET}/hf/*.safetensors")) > 1  # sharded, uploaded whole
    assert same(from_hf(f"gs://{BUCKET}/hf"))
    assert convert.main(["--from-hf", f"gs://{BUCKET}/hf", "--to-orbax", f"gs://{BUCKET}/converted",
                         "--no-progress"]) == 0
    assert same(checkpoint.restore_model(f"gs://{BUCKET}/converted")[0])
    assert not any(p.name != "cache" for p in tmp_path.iterdir())  # downloads only into the storage cache


def test_fresh_clears_a_bucket_run_dir_but_its_lock(gcs):
    from k3jax.training.trainer import clear_run_dir

    run = f"gs://{BUCKET}/fresh"
    for name in ("config.yaml", "checkpoints/2/x", "tensorboard/e", run_lock.LOCK_FILE):
        storage.write_text(f"{run}/{name}", name)
    clear_run_dir(storage.path(run))
    _, fs = gcs
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/fresh")] == [run_lock.LOCK_FILE]


def test_a_failed_save_in_a_bucket_lists_no_partial_step(gcs, monkeypatch):
    """No rename on GCS: orbax marks a finished step with commit_success.txt, and a step without it is not
    listed, so a resume never picks a half-written one."""
    import errno

    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    from k3jax import create_model
    from k3jax.training import checkpoint
    from k3jax.config import load_config

    cfg = load_config("tiny", ["model.num_layers=1"])
    model = create_model(cfg.model)
    url = f"gs://{BUCKET}/failing"
    checkpoint.save_model(url, model, cfg, step=1)
    writer = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def disk_full(self, x, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_model(url, model, cfg, step=2)
    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", writer)
    _, fs = gcs
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/failing/2") and not fs.exists(f"{BUCKET}/failing/2/commit_success.txt")
    assert checkpoint.manager(url).all_steps() == [1] and checkpoint.restore_model(url)[1].model == cfg.model


def test_a_tokenizer_in_a_bucket(gcs, tmp_path, monkeypatch):
    from k3jax.tokenizer import load_tokenizer

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "in": 1, "the": 2, "beginning": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    storage.write_bytes(f"gs://{BUCKET}/tok/tokenizer.json", (tmp_path / "tokenizer.json").read_bytes())
    for spec in (f"gs://{BUCKET}/tok", f"gs://{BUCKET}/tok/tokenizer.json"):
        assert load_tokenizer(spec).encode("in the beginning") == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="neither 'byte' nor an existing path"):
        load_tokenizer(f"gs://{BUCKET}/nothing")
