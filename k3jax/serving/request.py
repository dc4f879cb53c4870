"""A request inside the serving engine: its sampling parameters and the :class:`Sequence` that carries its
prompt, its generated tokens and the callbacks that stream them (``k3jax.serving.engine`` runs it;
``k3jax.serving.schedule`` carries it between processes)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from k3jax.serving.logprobs import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed per request
    stop_ids: tuple[int, ...] = ()  # generation ends after one of these (not passed to on_token)
    logprobs: int | None = None  # log-probabilities of each token and this many alternatives; None: none
    prompt_logprobs: bool = False  # the prompt's too (its first token has none); max_tokens may then be 0


class Sequence:
    """One request inside the engine. ``on_token(id, logprobs)`` (a ``TokenLogprobs`` when
    ``params.logprobs`` is set, else None) and ``on_finish(reason)`` are called from the engine
    thread; ``reason`` is ``stop``, ``length``, ``cancelled`` or ``error``. With
    ``params.prompt_logprobs``, ``prompt_logprobs`` (one entry per prompt token, the first None) is
    set before the first of these calls."""

    def __init__(self, prompt, params: SamplingParams, on_token: Callable[[int, TokenLogprobs | None], None],
                 on_finish: Callable[[str], None]):
        self.id = -1  # set by Engine.submit: the request's number in the schedule
        self.seed = params.seed  # Engine.submit draws one when None
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.on_token, self.on_finish = on_token, on_finish
        self.generated: list[int] = []
        self.cancelled: str | None = None  # the finish reason to report once the engine drops it
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        # An engine that records rollouts (``record_routes``; reinforcement learning, k3jax.rl): per prompt
        # token (set before on_token is first called) and per generated token, its selected experts in every
        # MoE layer ``[M, k]`` int32, and each generated token's log-probability under the sampling
        # distribution (the logits at the request's temperature; the raw logits when greedy).
        self.prompt_routes: np.ndarray | None = None  # [len(prompt), M, k]
        self.routes: list[np.ndarray] = []
        self.sampled_logprobs: list[float] = []
