"""Reinforcement learning settings (``train.rl``; ``k3jax/rl``, docs/design.md "Reinforcement learning")."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from k3jax.config.fields import check, runtime


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO-family RL with verifiable rewards: each step samples ``group_size`` completions of
    ``prompts_per_step`` prompts with the serving engine on the trainer's weights, scores them, and takes
    ``updates_per_rollout`` optimizer steps on the completions' tokens. ``loss = off``: not an RL run."""

    loss: Literal["off", "grpo", "dr_grpo", "dapo", "gspo"] = "off"
    # prompt records (JSONL / parquet / ArrayRecord with `prompt` or chat `messages` and the fields the rewards
    # read), or `bundled`: the bundled chat set's questions with their answers (k3jax/rl/prompts.py)
    prompts: str = "bundled"
    # keep only the prompts whose last message (or text) this regex is found in (both splits); None: all
    prompt_pattern: str | None = None
    eval_fraction: float = 0.1  # held-out prompts (the chat fine-tune's held-out conversations for `bundled`)
    group_size: int = 4  # G completions per prompt
    prompts_per_step: int = 4  # P prompts per step: the step's batch is P x G rows (train.batch_size)
    max_new_tokens: int = 32  # the completions' length limit (prompt + completion fit train.seq_len)
    temperature: float = 1.0  # the rollout's sampling temperature; the trainer's log-probabilities use it too
    top_p: float = 1.0
    updates_per_rollout: int = 1  # optimizer steps on each rollout batch (> 1: the ratio moves off 1)
    # None: the objective's preset (GRPO 0.2 / 0.2, DAPO 0.2 / 0.28, GSPO 3e-4 / 4e-4)
    clip_low: float | None = None
    clip_high: float | None = None
    # how token losses add up: auto = the objective's own (GRPO, GSPO: per sequence; DAPO: per token;
    # Dr.GRPO: fixed, sum / (rows x max_new_tokens))
    aggregation: Literal["auto", "sequence", "token", "fixed"] = "auto"
    # KL to the reference (k3 estimator): the run's starting weights (train.init_from, or its seed init), a
    # LoRA run's frozen base (no second model) or, for a full fine-tune, a frozen copy (a second copy of the weights)
    beta: float = 0.0
    tis_threshold: float = 0.0  # truncated importance sampling against the rollout's log-probabilities; 0: off
    dynamic_sampling: bool | None = None  # drop groups whose rewards are all equal; None: DAPO only
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last this many tokens; 0: off
    overlong_penalty: float = 1.0
    # record each token's experts in the rollout and use them in the training forward (MoE models)
    routing_replay: bool = True
    # the rollout engine's weight layout on the mesh: `training` (the trainer's arrays as they are: no copy, but
    # each decode step gathers what FSDP split) or `serving` (a copy split once over every device, made each step:
    # no weight moves in a decode step; the copy and the serving layout's caches cost memory: docs/scale.md)
    rollout_layout: Literal["training", "serving"] = "training"
    # reward functions: built-in names (exact_match, format, math) or module:function; weights 1 if empty
    rewards: tuple[str, ...] = ("exact_match",)
    reward_weights: tuple[float, ...] = ()
    answer_field: str = "answer"
    answer_pattern: str | None = None  # exact_match's extraction regex (None: the last number)
    format_pattern: str | None = None  # format's regex
    # multi-turn episodes with tools (k3jax/rl/episodes.py): `calculator`, `python` (a sandbox per episode) or
    # module:function returning an environment for a record; None: one reply per prompt
    environment: str | None = None
    max_turns: int = 4  # model turns per episode
    # multi-turn: the rollout engine's prefix cache (tokens), from which each turn resumes after its history's last
    # whole block instead of prefilling the history again; None: room for every row's whole row (rows x
    # (seq_len + 1)); 0: off. Each block holds its KDA layers' states: the engine logs a block's bytes
    prefix_cache_tokens: int | None = None
    # an extra forward per step without replay: the fraction of routing decisions that differ, and the
    # rollout / trainer KL without replay
    measure_mismatch: bool = runtime(True)
    eval_every: int = runtime(0)  # held-out accuracy every this many steps (and at start and end); 0: start and end
    eval_prompts: int = runtime(32)  # held-out prompts scored (greedy, one completion each)

    @property
    def enabled(self) -> bool:
        return self.loss != "off"

    @property
    def rows(self) -> int:
        """The rollout batch: every prompt's group."""
        return self.prompts_per_step * self.group_size

    def validate(self, prefix: str = "train.rl") -> None:
        if not self.enabled:
            return
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "updates_per_rollout"):
            check(getattr(self, name) > 0, f"{prefix}.{name}", "must be positive")
        check(self.group_size > 1, f"{prefix}.group_size", "group-relative advantages need at least 2 completions")
        check(self.temperature > 0, f"{prefix}.temperature", "must be positive (the policy samples)")
        check(0 < self.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]")
        check(0 <= self.eval_fraction < 1, f"{prefix}.eval_fraction", "must be in [0, 1)")
        for name in ("clip_low", "clip_high"):
            v = getattr(self, name)
            check(v is None or v >= 0, f"{prefix}.{name}", "must be >= 0")
        check(self.beta >= 0, f"{prefix}.beta", "must be >= 0")
        check(self.tis_threshold == 0 or self.tis_threshold >= 1, f"{prefix}.tis_threshold",
              "must be 0 (off) or >= 1 (the cap on the importance weight)")
        check(0 <= self.overlong_buffer < self.max_new_tokens, f"{prefix}.overlong_buffer",
              f"must be in [0, max_new_tokens={self.max_new_tokens})")
        check(bool(self.rewards), f"{prefix}.rewards", "name at least one reward function")
        check(not self.reward_weights or len(self.reward_weights) == len(self.rewards), f"{prefix}.reward_weights",
              f"one weight per reward function ({len(self.rewards)}), or none")
        check(self.eval_every >= 0, f"{prefix}.eval_every", "must be >= 0")
        check(self.max_turns > 0, f"{prefix}.max_turns", "must be positive")
        check(self.prefix_cache_tokens is None or self.prefix_cache_tokens >= 0, f"{prefix}.prefix_cache_tokens",
              "must be >= 0 (0: off)")
        if self.prompt_pattern is not None:
            try:
                re.compile(self.prompt_pattern)
            except re.error as e:
                check(False, f"{prefix}.prompt_pattern", f"{self.prompt_pattern!r} is not a regular expression ({e})")


__all__ = ["RLConfig"]
