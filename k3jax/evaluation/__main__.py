"""``python -m k3jax.evaluation``: the command line of ``k3jax.evaluation.cli``."""

from k3jax.evaluation.cli import main

main()
