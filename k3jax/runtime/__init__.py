"""The process's environment, shared by training, serving, evaluation and the AOT tooling: multi-host
start-up (``distributed``), the persistent compilation cache (``compile_cache``), glibc's malloc settings for
XLA:CPU's temporaries (``host_memory``; imported before jax by ``k3jax/__init__.py``, so this package imports
nothing) and local / ``gs://`` paths (``storage``)."""
