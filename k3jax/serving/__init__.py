"""Serving: an OpenAI-compatible HTTP server with continuous batching (``python infer.py --serve``).

- ``engine``: the pool of cache rows and the background decode loop (continuous batching);
- ``request``: a request inside the engine (``Sequence``) and its ``SamplingParams``;
- ``programs``: the engine's jitted device programs (prefill, insert, realign, decode);
- ``prefill``: how a batch of prompts is cut into prefill pieces;
- ``schedule``: each iteration's input to that loop (requests, cancellations, stop): local in one process,
  broadcast by process 0 to the others on several hosts;
- ``loading``: a checkpoint in its stored dtype, and its weight bytes per device;
- ``sampling``: per-row temperature / top-p sampling;
- ``text``: chat prompts, incremental detokenisation with stop strings;
- ``api``: the FastAPI app: its routes and the OpenAI requests' validation and handling;
- ``api_schemas``: the OpenAI request bodies and the error body; ``replies``: the response bodies;
- ``transport``: request bodies under a size limit, the drain on shutdown, event streams that cancel;
- ``metrics``: Prometheus counters, gauges and the time-to-first-token histogram;
- ``auth``: the API key (``--api-key``); ``profiling``: ``jax.profiler`` traces of the engine's next steps;
- ``server``: command-line options and the uvicorn start (process 0; the other processes follow).
"""

from k3jax.serving.engine import Engine, QueueFull
from k3jax.serving.request import SamplingParams, Sequence

__all__ = ["Engine", "QueueFull", "SamplingParams", "Sequence"]
