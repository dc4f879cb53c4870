"""train.py end to end (the interrupted and resumed run: tests/test_pod_job.py, which uses this module's
``train_cmd``): corrupt, partial and mismatched checkpoints fail clearly and are kept;
a rolled-back run drops the metrics of its abandoned steps; a changed ``train.steps`` that would make
the learning rate jump is refused on resume unless ``--reschedule``."""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cpu_devices import subprocess_env
from k3jax.training import checkpoint
from k3jax.config import load_config
from k3jax.training.run_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A two-layer tiny K3 on short rows: KDA with the dense FFN, MLA with a latent MoE (QB on), Block AttnRes
# closing a block after each layer, per-head Muon. Compile time grows with the (unrolled) layers.
SMALL = ["model.num_layers=2", "model.attn_res.block_size=1", "train.seq_len=32", "train.batch_size=4",
         "train.grad_accum=2", "train.log_every=1", "train.checkpoint_every=4", "train.optim.warmup_steps=2"]
STEPS = 12


def train_cmd(run_dir, *extra):
    return [sys.executable, str(ROOT / "train.py"), "--sample-tokens", "0", *SMALL, f"train.steps={STEPS}",
            f"run_dir={run_dir}", *extra]


def train_env():
    # The suite's persistent compilation cache (cpu_devices.compile_cache_env), every program in it: one
    # compile for a test's processes (the later ones load it), none in a later run of the suite.
    return subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def logged_steps(run_dir) -> int:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()), default=0)


# --- checkpoint failures (no compilation: the state is saved and restored eagerly) -----------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint of a fresh tiny TrainState at step 3, and the config that wrote it."""
    from flax import nnx

    from k3jax.data.pipeline import make_train_dataset
    from k3jax.model import create_model
    from k3jax.optim import make_optimizer
    from k3jax.training.step import TrainState

    run = tmp_path_factory.mktemp("run")
    cfg = load_config("tiny", SMALL + [f"train.out_dir={run}"])
    state = _train_state(cfg, create_model, make_optimizer, TrainState, nnx)
    it = iter(make_train_dataset(cfg.train))
    next(it)
    with checkpoint.manager(run / "checkpoints", item_names=checkpoint.TRAIN_ITEMS) as mngr:
        checkpoint.save_train_state(mngr, 3, cfg, state, it)
        mngr.wait_until_finished()
    return cfg, run / "checkpoints", next(it)


def _train_state(cfg, create_model, make_optimizer, TrainState, nnx, seed=None):
    model = create_model(cfg.model, seed=cfg.train.seed if seed is None else seed)
    with nnx.use_eager_sharding(False):
        return TrainState(model, make_optimizer(cfg.train.optim, model, cfg.train.steps))


def _restore(cfg, directory, seed=1):
    from flax import nnx

    from k3jax.data.pipeline import make_train_dataset
    from k3jax.model import create_model
    from k3jax.optim import make_optimizer
    from k3jax.training.step import TrainState

    state = _train_state(cfg, create_model, make_optimizer, TrainState, nnx, seed=seed)
    it = iter(make_train_dataset(cfg.train))
    with checkpoint.manager(directory, item_names=checkpoint.TRAIN_ITEMS) as mngr:
        step = checkpoint.restore_train_state(mngr, cfg, state, it)
    return step, state, it


def test_restore_brings_back_state_and_data_position(saved_run):
    from flax import nnx

    cfg, directory, next_batch = saved_run
    longer = load_config("tiny", SMALL + [f"train.out_dir={directory.parent}", "train.steps=500"])
    step, state, it = _restore(longer, directory)  # train.steps may change on resume
    assert step == 3
    reference = nnx.state(checkpoint.restore_model(directory)[0])
    for a, b in zip(jax_leaves(nnx.state(state.model)), jax_leaves(reference)):
        np.testing.assert_array_equal(a, b)
    for k, v in next(it).items():
        np.testing.assert_array_equal(v, next_batch[k])


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.parametrize("override,field", [("model.hidden_size=32", "model.hidden_size"),
                                            ("train.batch_size=8", "train.batch_size"),
                                            ("train.optim.learning_rate=0.1", "train.optim.learning_rate")])
def test_config_mismatch_is_caught(saved_run, override, field):
    cfg, directory, _ = saved_run
    other = load_config("tiny", SMALL + [f"train.out_dir={directory.parent}", override])
    with pytest.raises(checkpoint.CheckpointError, match=field.replace(".", r"\.")):
        _restore(other, directory)


def test_corrupt_checkpoint_fails_clearly_and_is_kept(saved_run, tmp_path):
    cfg, directory, _ = saved_run
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy)
    for f in (copy / "3" / "model").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data files
            f.write_bytes(b"not a tensorstore chunk")
    with pytest.raises(checkpoint.CheckpointError, match=r"corrupt or incomplete.*Nothing was deleted") as error:
        _restore(cfg, copy)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or incomplete") as served:  # infer.py's path
        checkpoint.restore_model(copy)
    for e in (error.value, served.value):  # one readable line; TensorStore's specs stay in the cause
        assert len(str(e)) < 600 and "tensorstore_spec" not in str(e) and "\n" not in str(e), str(e)
        assert "is not valid for value of size" in str(e)  # the precise cause, at the end of its chain
        assert "tensorstore_spec" in str(e.__cause__)
    assert (copy / "3" / "model").is_dir()
    assert checkpoint.manager(copy).all_steps() == [3]


def test_partial_save_is_ignored(saved_run, tmp_path):
    """A save killed before orbax's final rename leaves a tmp directory; the last complete step wins."""
    cfg, directory, _ = saved_run
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy)
    (copy / "7.orbax-checkpoint-tmp-1234" / "model").mkdir(parents=True)
    step, _, _ = _restore(cfg, copy)
    assert step == 3


def test_train_cli_reports_a_mismatch_without_touching_checkpoints(saved_run, capsys):
    sys.path.insert(0, str(ROOT))
    import train

    cfg, directory, _ = saved_run
    before = sorted(p.name for p in directory.iterdir())
    code = train.main(["--sample-tokens", "0", *SMALL, "model.hidden_size=32", f"run_dir={directory.parent}"])
    assert code == 1
    assert "model.hidden_size" in capsys.readouterr().err
    assert sorted(p.name for p in directory.iterdir()) == before


def test_train_cli_refuses_a_schedule_jump_on_resume(saved_run, capsys):
    """The saved run's cosine schedule spans 300 steps; resuming it at step 3 with train.steps=4 would
    move the learning rate of the next update."""
    sys.path.insert(0, str(ROOT))
    import train

    cfg, directory, _ = saved_run
    before = sorted(p.name for p in directory.iterdir())
    code = train.main(["--sample-tokens", "0", *SMALL, "train.steps=4", f"run_dir={directory.parent}"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "train.steps 300 -> 4" in err and "--reschedule" in err, err
    assert sorted(p.name for p in directory.iterdir()) == before


@pytest.mark.parametrize("optim,old,new,step,allowed", [
    ([], 300, 600, 3, False),                                  # cosine over the run: the LR jumps
    ([], 300, 600, 1, True),                                   # still in warmup: same LR
    (["train.optim.decay_steps=100"], 300, 600, 50, True),     # cosine of fixed length
    (["train.optim.schedule=constant"], 300, 30, 10, True),
    (["train.optim.schedule=wsd"], 300, 600, 100, True),       # stable phase: extending moves the decay
    (["train.optim.schedule=wsd"], 300, 600, 280, False),      # inside the decay
])
def test_check_schedule(optim, old, new, step, allowed):
    from k3jax.training.trainer import ScheduleChangeError, check_schedule

    saved, cfg = (load_config("tiny", SMALL + optim + [f"train.steps={n}"]) for n in (old, new))
    if allowed:
        assert "unchanged" in check_schedule(saved, cfg, step, reschedule=False)
    else:
        with pytest.raises(ScheduleChangeError, match=f"train.steps {old} -> {new}.*at step {step}"):
            check_schedule(saved, cfg, step, reschedule=False)
        assert "--reschedule" in check_schedule(saved, cfg, step, reschedule=True)
    assert check_schedule(saved, saved, step, reschedule=False) is None


def test_resuming_drops_the_metrics_of_rolled_back_steps(tmp_path):
    """After the newest checkpoint is deleted the run resumes from an older step: the records logged
    after it are dropped and the loss plot is redrawn from what remains."""
    from k3jax.training.run_log import LOSS_PLOT, RunLog, plot_losses

    log = RunLog(tmp_path, step=0, tensorboard=False)
    for step in range(1, 9):
        log.write({"step": step, "loss": 5.0 - 0.1 * step})
        if step % 4 == 0:
            log.write({"step": step, "eval_loss": 5.0 - 0.1 * step})
    log.close()
    plot_losses(tmp_path)
    before = (tmp_path / LOSS_PLOT).read_bytes()

    resumed = RunLog(tmp_path, step=4, tensorboard=False)
    assert resumed.rolled_back == 5  # losses 5..8 and the eval at 8
    resumed.write({"step": 5, "loss": 1.0})
    resumed.close()
    assert [(r["step"], "eval_loss" in r) for r in read_metrics(tmp_path)] == (
        [(s, False) for s in range(1, 4)] + [(4, False), (4, True), (5, False)])
    assert (tmp_path / LOSS_PLOT).read_bytes() != before
    again = RunLog(tmp_path, step=5, tensorboard=False)
    again.close()
    assert again.rolled_back == 0


def _tensorboard_scalars(run_dir) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the run's TensorBoard event files, read as TensorBoard does:
    TFRecords (length, its CRC, an ``Event`` proto, its CRC) of ``tensorboard/events.out.tfevents.*``."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted((pathlib.Path(run_dir) / "tensorboard").glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            out.extend((event.step, v.tag, v.simple_value) for v in event.summary.value)
    return out


def test_run_log_writes_tensorboard_scalars_without_importing_torch(tmp_path):
    """The run log's scalars reach TensorBoard's event files, and a training process does not pay for
    importing torch to write them (tensorboardX imports it where it can)."""
    code = ("import sys; from k3jax.training.run_log import RunLog; log = RunLog(sys.argv[1], step=0); "
            "log.write({'step': 3, 'loss': 2.5, 'expert_imbalance': {'1': 1.25}}); log.close(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(), check=True, timeout=300)
    scalars = _tensorboard_scalars(tmp_path)
    assert (3, "loss", 2.5) in scalars and any(step == 3 and value == 1.25 for step, _, value in scalars), scalars
