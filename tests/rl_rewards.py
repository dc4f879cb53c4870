"""Reward functions and an environment of the RL loop tests (named ``rl_rewards:NAME`` in a config; the tests
directory is on the child processes' path)."""

import os
import signal

_calls = {"n": 0}


def lowercase_fraction(prompts, completions, **fields):
    """The share of a completion's characters that are lower-case ASCII letters: a reward a random byte-level
    model starts near 0.1 on and can raise by shifting its output distribution."""
    return [sum("a" <= ch <= "z" for ch in c) / max(len(c), 1) for c in completions]


def lowercase_fraction_then_sigint(prompts, completions, **fields):
    """``lowercase_fraction``, sending this process SIGINT (Ctrl-C) at its call number ``RL_TEST_SIGINT_AT``:
    the run finishes that step, saves and exits 130."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("RL_TEST_SIGINT_AT", "0")):
        os.kill(os.getpid(), signal.SIGINT)
    return lowercase_fraction(prompts, completions)


class ToolRoundTrip:
    """An environment (``rl_rewards:tool_round_trip``) that answers an episode's first model turn with a tool
    message, whatever the model said, and ends the episode at the next (its reward: the reward functions'): a
    tool round trip independent of what a random model writes."""

    tools = []  # none advertised

    def __init__(self):
        self.turns = 0

    def step(self, messages):
        from k3jax.rl.environments import EnvTurn

        self.turns += 1
        if self.turns == 1:
            return EnvTurn(messages=({"role": "tool", "tool_call_id": "call_0", "content": "the tool's answer"},))
        return EnvTurn(done=True)

    def close(self):
        return None


def tool_round_trip(record):
    return ToolRoundTrip()
