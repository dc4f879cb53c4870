"""The training run: the jitted step and init (``step``), the run behind ``train.py`` (``trainer``: resume,
rollback, evaluation, checkpoints, the sample), orbax checkpoints (``checkpoint``), one process per run
directory (``run_lock``) and the run's metrics (``run_log``)."""
