"""Compiles one small function with the persistent compilation cache on (``K3JAX_COMPILE_CACHE``) and prints
``hits=<n> misses=<n> warnings=<n>`` (the cache's hits and misses, and warnings that mention the cache). Run by
``tests/test_compile_cache.py``, several at once."""

import warnings

import jax
import jax.numpy as jnp

from k3jax.runtime import compile_cache


def main() -> None:
    counts = {"hits": 0, "misses": 0}

    def listen(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
        if event == "/jax/compilation_cache/cache_misses":
            counts["misses"] += 1

    jax.monitoring.register_event_listener(listen)
    compile_cache.enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T + jnp.tanh(x).sum())
        y = f(jnp.ones((64, 64)))
        y.block_until_ready()
    cache_warnings = [w for w in caught if "cache" in str(w.message).lower()]
    print(f"hits={counts['hits']} misses={counts['misses']} warnings={len(cache_warnings)}")


if __name__ == "__main__":
    main()
