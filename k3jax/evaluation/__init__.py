"""Evaluating checkpoints with lm-evaluation-harness.

- ``lm``: the harness model ``k3jax`` (registered on import): requests batched through the serving
  engine in this process;
- ``tasks/``: bundled tasks for ``--include_path`` (``kjv_cloze``: a multiple-choice task built from
  the bundled corpus); :data:`TASKS_DIR` is their directory.

``python -m k3jax.evaluation`` runs lm-eval's command line with both (``cli``).
"""

import pathlib

from k3jax.evaluation.lm import K3JaxLM

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"

__all__ = ["K3JaxLM", "TASKS_DIR"]
