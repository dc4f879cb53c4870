"""One process of a two-process job (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``)
checking its rollout against the other's (``k3jax.rl.agreement``): the same rollout passes; rewards that differ
on process 1 stop both processes with ``RolloutDivergenceError``, whose message it prints before ``OK``."""

import numpy as np

from k3jax.runtime import distributed


def main() -> None:
    distributed.initialize("on")
    import jax

    from k3jax.rl.agreement import RolloutDivergenceError, check_same_rollout

    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    logprobs = np.full((3, 4), -0.5, np.float32)
    check_same_rollout(1, tokens, logprobs, np.array([0.5, 1.0, 0.0]))
    try:
        check_same_rollout(2, tokens, logprobs, np.array([0.5, 1.0, float(jax.process_index())]))
    except RolloutDivergenceError as e:
        print(e)
        print("OK")


if __name__ == "__main__":
    main()
