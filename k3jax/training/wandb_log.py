"""Weights & Biases as one more sink of the run log (``train.wandb``): :class:`~k3jax.training.run_log.RunLog`
hands every record it writes to ``metrics.jsonl`` and TensorBoard to :class:`WandbRun` too, so W&B gets the
same scalars under TensorBoard's names at the same steps; the run's resolved config is the W&B run's config.

Resume: the W&B run's id is kept in ``<run_dir>/wandb_run_id``; the restarted run (the same command) opens
the same W&B run (``resume="allow"``). W&B cannot drop points: those a killed run logged past its last
checkpoint stay, and W&B ignores the resumed run's records of steps below its latest (the same batches from
the same weights). ``--fresh`` deletes the run directory, id included: a new W&B run.

W&B's local files go where W&B puts them (``WANDB_DIR``, else ``./wandb``); ``mode=offline`` writes only
there, for a later ``wandb sync``.
"""

from __future__ import annotations

from typing import Any

from k3jax.config import Config, to_dict
from k3jax.runtime import storage

ID_FILE = "wandb_run_id"


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ModuleNotFoundError("train.wandb.mode is on but the wandb package is not installed: "
                                  "pip install 'k3jax[wandb]' (or set train.wandb.mode=off)") from None
    return wandb


class WandbRun:
    """The W&B run of a run directory, created or resumed (module docstring)."""

    def __init__(self, run_dir, config: Config):
        wandb = _wandb()
        wc = config.train.wandb
        run_dir = storage.path(run_dir)
        id_path = run_dir / ID_FILE
        run_id = storage.read_text(id_path).strip() if id_path.exists() else None  # None: W&B makes one
        # allow_val_change: a resume may change the runtime fields (train.steps, logging, the mesh)
        self.run = wandb.init(mode=wc.mode, project=wc.project, entity=wc.entity or None, name=wc.name or run_dir.name,
                              tags=list(wc.tags), id=run_id, resume="allow", config=to_dict(config),
                              allow_val_change=True)
        if run_id is None:
            storage.write_text(id_path, self.run.id)

    def log(self, scalars: dict[str, Any], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


__all__ = ["ID_FILE", "WandbRun"]
