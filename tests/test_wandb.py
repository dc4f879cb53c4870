"""``train.wandb``: a tiny run logged by the real ``wandb`` package in offline mode puts the scalars of
``metrics.jsonl`` (TensorBoard's names, the same steps) and the resolved config in its W&B run, and the
restarted run goes on in the same W&B run (the id kept in the run directory). The offline run's
transaction log (``run-<id>.wandb``) is read back as W&B's own sync would read it."""

from __future__ import annotations

import json
import math
import pathlib
import struct

import pytest

from k3jax.config import load_config
from k3jax.training.run_log import read_metrics
from k3jax.training.wandb_log import ID_FILE

RUN = ["model.num_layers=1", "train.seq_len=16", "train.batch_size=2", "train.log_every=1",
       "train.optim.schedule=constant", "train.optim.warmup_steps=0", "train.wandb.mode=offline",
       "train.wandb.project=k3jax-test", "train.wandb.tags=[tiny]"]

# wandb's transaction log: a LevelDB log (32 KiB blocks of records: CRC32 u32, length u16, type u8 -
# 1 full, 2 first, 3 middle, 4 last - then the bytes) after a 7-byte header (":W&B", magic 0xBEE1, version 0)
HEADER, BLOCK, RECORD_HEADER = b":W&B\xe1\xbe\x00", 32768, 7


def wandb_records(path: pathlib.Path):
    """The ``wandb_internal_pb2.Record`` protos of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, data[:8]
    pos, pending, out = len(HEADER), b"", []
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + RECORD_HEADER])
        pending += data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def offline_run(wandb_dir: pathlib.Path, run_id: str, n: int):
    """The records of the ``n``-th (0-based, by start time) offline W&B run of id ``run_id``."""
    runs = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    return wandb_records(runs[n] / f"run-{run_id}.wandb")


def history(records) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of the logged history, rows of one step merged."""
    out: dict[int, dict] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            out.setdefault(row.pop("_step"), {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return out


def config_of(records) -> dict:
    """The W&B run's config: {top-level key: value} of its run record and later config records."""
    out = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            update = rec.run.config.update if kind == "run" else rec.config.update
            out.update({item.key: json.loads(item.value_json) for item in update})
    return out


def metrics_scalars(run_dir) -> dict[int, dict[str, float]]:
    """metrics.jsonl's scalars under TensorBoard's names (a per-layer dict as ``name/layer_<i>``)."""
    out: dict[int, dict] = {}
    for rec in read_metrics(run_dir):
        row = out.setdefault(rec["step"], {})
        for key, value in rec.items():
            if isinstance(value, dict):
                row.update({f"{key}/layer_{i}": v for i, v in value.items()})
            elif key != "step":
                row[key] = value
    return out


@pytest.mark.usefixtures("fast_xla_test")
def test_wandb_offline_run_logs_the_metrics_and_resumes_in_the_same_run(tmp_path, monkeypatch):
    from k3jax.training.trainer import train

    wandb_dir, run_dir = tmp_path / "wandb_files", tmp_path / "run"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny", RUN + ["train.steps=2", f"train.out_dir={run_dir}"])
    assert not train(cfg, sample_tokens=0)["interrupted"]

    run_id = (run_dir / ID_FILE).read_text().strip()
    records = offline_run(wandb_dir, run_id, 0)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (run_id, "k3jax-test", "run", ["tiny"])
    logged, expected = history(records), metrics_scalars(run_dir)
    assert sorted(logged) == sorted(expected) == [1, 2]  # steps 1, 2 and the closing eval at 2
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"} <= set(expected[2])
    for step, row in expected.items():
        assert set(logged[step]) == set(row), step
        for name, value in row.items():
            assert math.isclose(logged[step][name], value, rel_tol=1e-12), (step, name)
    config = config_of(records)
    assert config["model"]["num_layers"] == 1 and config["train"]["wandb"]["mode"] == "offline"
    assert config["train"]["steps"] == 2

    # the same command, one step longer: it resumes the checkpoint and the W&B run
    cfg = load_config("tiny", RUN + ["train.steps=3", f"train.out_dir={run_dir}"])
    assert not train(cfg, sample_tokens=0)["interrupted"]
    assert (run_dir / ID_FILE).read_text().strip() == run_id
    records = offline_run(wandb_dir, run_id, 1)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id
    assert sorted(history(records)) == [3] and history(records)[3]["loss"] == metrics_scalars(run_dir)[3]["loss"]
    assert config_of(records)["train"]["steps"] == 3


def test_wandb_off_writes_no_run(tmp_path):
    """The default: no W&B run, no id file (RunLog never touches wandb)."""
    from k3jax.training.run_log import RunLog

    log = RunLog(tmp_path, step=0, tensorboard=False, config=load_config("tiny"))
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / ID_FILE).exists() and not (tmp_path / "wandb").exists()
