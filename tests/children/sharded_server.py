"""The serving checks of ``tests/test_serving.py`` (concurrent requests equal each alone, bad inputs, a fixed
set of compiled programs) against a server whose model is split over 4 devices (``fsdp=4``). Run by
``tests/test_serving.py``."""

import jax

import test_serving as t
from k3jax.serving.engine import Engine
from k3jax.sharding import make_mesh, parse_mesh, shard_model, use_mesh


def main() -> None:
    jax.config.update("jax_disable_most_optimizations", True)
    assert jax.device_count() == 4
    mesh = make_mesh(parse_mesh("fsdp=4"))
    model = shard_model(t.small_model(), mesh)
    engine = Engine(model, max_batch=t.MAX_BATCH, max_len=t.MAX_LEN, prefill_chunk=t.CHUNK, max_queue=16, mesh=mesh)
    with t.running_server(engine) as url, use_mesh(mesh):
        t.check_concurrent_equals_alone(url, model, n=8, seed=3)
        t.check_bad_inputs(url)
        t.check_compiles_fixed(url)
    print("OK")


if __name__ == "__main__":
    main()
