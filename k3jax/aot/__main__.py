"""``python -m k3jax.aot``: the command line of ``k3jax.aot.cli``."""

from k3jax.aot.cli import main

main()
