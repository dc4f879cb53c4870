"""The minor page faults of each of ``CALLS`` calls (argv) of a jitted function whose temporary is one
128 MiB block, and whether importing k3jax made glibc keep freed memory (``K3JAX_HOST_MEMORY``): a JSON
line. Run by ``tests/test_host_memory.py`` in a fresh process (the setting must come before ``import jax``
starts its threads)."""

import json
import resource
import sys

import k3jax  # noqa: F401 - first: applies K3JAX_HOST_MEMORY before jax starts
from k3jax.runtime import host_memory
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main(calls: int) -> None:
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x)[::-1] * 2.0))  # a temporary the size of x
    x = jnp.ones((32 << 20,), jnp.float32)
    faults = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"faults": faults, "keeps": host_memory.keeps_host_memory()}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
