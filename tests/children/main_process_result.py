"""One process of a two-process job (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``)
taking process 0's result (``distributed.main_process_result``): every process gets what process 0 computed (its
own computation never runs elsewhere), and an exception there is raised on both; prints ``OK``."""

from k3jax.runtime import distributed


def main() -> None:
    distributed.initialize("on")
    import jax

    rank, ran = jax.process_index(), []

    def compute():
        ran.append(rank)
        return {"rank": rank, "text": "tool: caf\u00e9 \u2713", "values": [0.1 * i for i in range(300)]}

    got = distributed.main_process_result(compute)
    assert got == {"rank": 0, "text": "tool: caf\u00e9 \u2713", "values": [0.1 * i for i in range(300)]}, got
    assert ran == ([0] if rank == 0 else []), ran

    def fail():
        raise ValueError("the reward function broke")

    try:
        distributed.main_process_result(fail)
    except ValueError as e:
        assert rank == 0 and str(e) == "the reward function broke"
    except distributed.MainProcessError as e:
        assert rank == 1 and str(e) == "process 0: ValueError: the reward function broke", e
    else:
        raise AssertionError("no exception")
    print("OK")


if __name__ == "__main__":
    main()
