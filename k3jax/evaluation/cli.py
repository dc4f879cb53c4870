"""``python -m k3jax.evaluation``: lm-evaluation-harness's command line with the ``k3jax`` model registered
and the bundled tasks (``k3jax/evaluation/tasks``) on the include path; ``--model`` defaults to
``k3jax``. Every lm-eval argument works as in ``lm_eval``, e.g.::

    python -m k3jax.evaluation --model_args checkpoint=runs/default --tasks kjv_cloze --batch_size 8 \\
        --log_samples --output_path out/

(``--include_path DIR`` takes DIR's tasks instead of the bundled ones: lm-eval takes one path.)
"""

from __future__ import annotations

import sys

import k3jax  # noqa: F401 (first: with K3JAX_HOST_MEMORY=keep it sets up host memory before jax starts threads)

import jax


def with_defaults(argv: list[str], tasks_dir: str) -> list[str]:
    """``argv`` (lm-eval's arguments) with ``--model k3jax`` unless a model is named and ``--include_path
    tasks_dir`` unless a path is named (lm-eval takes one)."""
    names = {a.split("=", 1)[0] for a in argv}
    return [*argv, *([] if "--model" in names else ["--model", "k3jax"]),
            *([] if "--include_path" in names else ["--include_path", tasks_dir])]


def main(argv: list[str] | None = None) -> None:
    from k3jax.runtime import compile_cache
    from k3jax.evaluation import TASKS_DIR
    from lm_eval.__main__ import cli_evaluate

    compile_cache.enable()  # $K3JAX_COMPILE_CACHE or ~/.cache/k3jax/jax ("off" disables)
    if jax.default_backend() == "cpu":
        jax.config.update("jax_disable_most_optimizations", True)  # as infer.py: compile time on CPU
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("run", "ls", "validate", "-h", "--help"):
        args = ["run", *with_defaults(args, str(TASKS_DIR))]
    elif args[0] == "run":
        args = ["run", *with_defaults(args[1:], str(TASKS_DIR))]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()
