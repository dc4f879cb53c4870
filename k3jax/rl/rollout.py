"""Rollouts: G completions per prompt sampled by the serving engine on the trainer's weights, and the
training rows built from them.

The engine (``k3jax.serving.engine``, built with ``record_routes``) decodes with the trainer's weights on the
training mesh (``Engine.set_weights``, in ``train.rl.rollout_layout``) and records, per token, the
log-probability it sampled with and the experts every MoE layer selected. Each completion's seed comes
from ``train.seed``, the step and its row, and the engine runs on the calling thread (``Engine.run``), so a
resumed run samples the same completions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.serving.engine import Engine
from k3jax.serving.request import SamplingParams, Sequence

# The random stream of the rollouts' sampling seeds (folded with train.seed, the step and the row).
ROLLOUT_STREAM = 3


@dataclasses.dataclass
class Completion:
    """One sampled completion of a prompt: the tokens after the prompt (the model's, and in a multi-turn
    episode the tool turns between them, ``k3jax.rl.episodes``), which of them the model sampled (and
    trains on), their log-probabilities under the sampling policy and every token's experts."""

    prompt: list[int]
    tokens: list[int]  # after the prompt; the model's turns end with their stop token when they stopped
    finish: str  # "stop", "length" (out of tokens), or "turns" (a multi-turn episode out of turns)
    logprobs: np.ndarray  # [len(tokens)] float32: each sampled token's log-probability (0 for the others)
    routes: np.ndarray | None  # [len(prompt) + len(tokens), M, k] int32: each token's experts (as input)
    trained: np.ndarray | None = None  # [len(tokens)] bool: sampled by the model (None: all of them)
    reply: str | None = None  # the final reply's text for the rewards (None: the tokens up to the stop)
    env_reward: float | None = None  # the environment's reward for the episode, when it gives one

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


def rollout_seed(seed: int, step: int, row: int, turn: int = 0) -> int:
    """The sampling seed of row ``row`` of step ``step``'s rollout, in the episode's turn ``turn`` (32 bits; any
    run with the same ``train.seed`` draws the same)."""
    return int(np.random.SeedSequence([seed, ROLLOUT_STREAM, step, row, turn]).generate_state(1)[0])


def sample(engine: Engine, prompts: list[list[int]], group_size: int, *, max_new_tokens: int | list[int],
           temperature: float, top_p: float, stop_ids: tuple[int, ...], seeds: list[int]) -> list[Completion]:
    """``group_size`` completions of each prompt, rows grouped by prompt (row ``i * G + j``: prompt i's j-th),
    sampled by ``engine`` (``record_routes``; not started) with one seed per row (and one token limit per row
    when ``max_new_tokens`` is a list)."""
    rows = [p for p in prompts for _ in range(group_size)]
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(rows)
    if len(seeds) != len(rows) or len(limits) != len(rows):
        raise ValueError(f"{len(seeds)} seeds and {len(limits)} token limits for {len(rows)} rows")
    seqs = [Sequence(p, SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, seed=s,
                                       stop_ids=stop_ids), on_token=_ignore, on_finish=_ignore)
            for p, n, s in zip(rows, limits, seeds)]
    engine.run(seqs)
    out = []
    for seq in seqs:
        routes = None
        if seq.prompt_routes is not None and seq.prompt_routes.shape[1]:
            routes = np.concatenate([seq.prompt_routes, np.stack(seq.routes)], axis=0).astype(np.int32)
        out.append(Completion(seq.prompt, list(seq.generated), seq.finish_reason,
                              np.asarray(seq.sampled_logprobs, np.float32), routes))
    return out


def _ignore(*args) -> None:
    return None


def training_rows(completions: list[Completion], seq_len: int, top_k: int, num_moe_layers: int) -> dict:
    """The rows of a batch: prompt + completion, left-aligned in ``seq_len`` (+1 for the last target).

    Returns numpy ``tokens, segment_ids, targets [B, T]`` int32, ``mask [B, T]`` float32 (1 where the
    target is a completion token), ``rollout_logp [B, T]`` float32 (the engine's, at those targets) and
    ``routes [B, T, M, k]`` int32 (each input token's recorded experts; padding takes experts 0..k-1). Only the
    model's own tokens are trained (``Completion.trained``), never a prompt's or a tool turn's.
    """
    b = len(completions)
    tokens, segment_ids, targets = (np.zeros((b, seq_len), np.int32) for _ in range(3))
    mask, rollout_logp = np.zeros((b, seq_len), np.float32), np.zeros((b, seq_len), np.float32)
    routes = np.broadcast_to(np.arange(top_k, dtype=np.int32), (b, seq_len, num_moe_layers, top_k)).copy()
    for i, c in enumerate(completions):
        row = c.prompt + c.tokens
        n = len(row) - 1  # inputs
        if n > seq_len:
            raise ValueError(f"a prompt of {len(c.prompt)} tokens and its completion of {len(c.tokens)} exceed "
                             f"train.seq_len={seq_len}")
        tokens[i, :n], targets[i, :n], segment_ids[i, :n] = row[:-1], row[1:], 1
        first = len(c.prompt) - 1  # the input position whose target is the first completion token
        mask[i, first:n] = 1.0 if c.trained is None else c.trained
        rollout_logp[i, first:n] = c.logprobs
        if c.routes is not None and num_moe_layers:
            routes[i, :n] = c.routes[:n]
    return dict(tokens=tokens, segment_ids=segment_ids, targets=targets, mask=mask, rollout_logp=rollout_logp,
                routes=routes)


__all__ = ["Completion", "ROLLOUT_STREAM", "rollout_seed", "sample", "training_rows"]
