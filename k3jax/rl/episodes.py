"""Multi-turn rollouts with tools (``train.rl.environment``): each completion is an episode of model turns and
the environment's tool turns, one training row.

Per turn, every episode still going samples one reply (``k3jax.rl.rollout.sample``: the engine, the trainer's
weights); the reply's tool calls are parsed in the checkpoint's chat format (``serving.assistant_reply``, or
the plain transcript's ``data.chat.parse_transcript_reply``) and handed to the episode's environment
(``k3jax.rl.environments``), whose tool messages are rendered after the reply in the same format and the
next turn goes on from there. An episode ends when the environment says done (the bundled ones do when
the model answers without calling a tool) or has nothing to say, its turns (``rl.max_turns``) or its row (``train.seq_len``) run out.

Several processes (a multi-host run): every process samples the same turns, but only process 0's
environments step, and their answers go to every process (``distributed.main_process_result``), so a tool
whose output varies (a clock, a sandbox's timing) cannot make the processes' episodes, and so their engines'
programs, diverge.

The row holds the whole conversation; only the model's tokens train (``Completion.trained``). Each token
keeps the experts of the step that first ran it: a model token's from the decode step that fed it, a tool
turn's from the prefill of the turn after it. The next turn does not prefill the history again: the engine's
prefix cache (on for multi-turn runs) holds every whole block of it, prompt and replies, with their
routes, so a turn prefills only the tokens after the last whole block (fewer than a block of the history,
and the tool turn). Those few history tokens run again; their routes in the row stay the first run's.
"""

from __future__ import annotations

import numpy as np

from k3jax.data.chat import parse_transcript_reply, render_chat, reply_stop_ids
from k3jax.rl.environments import EnvFactory, EnvTurn
from k3jax.rl.prompts import PromptRecord
from k3jax.rl.rollout import Completion, sample
from k3jax.runtime.distributed import main_process_result
from k3jax.serving.assistant_reply import parse_reply, reply_stream
from k3jax.serving.engine import Engine


def assistant_message(tokenizer, text: str) -> dict:
    """A model turn's text (without its stop token) as an OpenAI assistant message, parsed in the tokenizer's
    chat format."""
    stream = reply_stream(tokenizer)
    if stream is None:
        reasoning, content, calls = parse_transcript_reply(text)
    else:
        reply = parse_reply(text, stream)
        reasoning, content, calls = reply.reasoning, reply.content, reply.tool_calls
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def continuation(tokenizer, conversation: list[dict], tools) -> list[int]:
    """The tokens that follow a model turn's stop token up to the next generation prompt: the tool messages
    that end ``conversation`` (after its last assistant message) and the assistant header, as the chat format
    renders them (what the format puts after an end-of-turn token, a newline, included)."""
    last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    through = render_chat(tokenizer, conversation[:last + 1], tools, add_generation_prompt=False)
    full = render_chat(tokenizer, conversation, tools, add_generation_prompt=True)
    if full[:len(through)] != through:
        raise ValueError("the chat format renders the conversation's tool turns by changing what came before them")
    end_of_turn = set(reply_stop_ids(tokenizer))
    ends = [i for i, t in enumerate(through) if t in end_of_turn]
    if not ends:
        raise ValueError("the chat format's assistant turn holds no end-of-turn token")
    return full[ends[-1] + 1:]


class _Episode:
    """One row's episode in progress."""

    def __init__(self, record: PromptRecord, env, tokenizer):
        self.env, self.tools = env, list(env.tools) or None
        self.conversation = [dict(m) for m in record.messages]
        self.prompt = render_chat(tokenizer, self.conversation, self.tools, add_generation_prompt=True)
        self.tokens: list[int] = []
        self.trained: list[bool] = []
        self.logprobs: list[float] = []
        self.routes: list[np.ndarray] = []  # per token of prompt + tokens that has run
        self.finish, self.reply, self.reward = None, "", None


def run_episodes(engine: Engine, tokenizer, records: list[PromptRecord], group_size: int, env_factory: EnvFactory,
                 *, max_turns: int, row_tokens: int, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: tuple[int, ...], seed) -> list[Completion]:
    """``group_size`` episodes of each chat prompt record (rows grouped by record), each with a fresh
    environment from ``env_factory(record.fields)``; ``row_tokens``: the most tokens an episode may hold,
    prompt included (``train.seq_len + 1``); ``max_new_tokens``: per model turn; ``seed(row, turn)``: the
    sampling seed of a row's turn."""
    episodes = []
    for r in records:
        if r.messages is None:
            raise ValueError(f"{r.where}: a multi-turn episode starts from a chat prompt (`messages`), not text")
        episodes += [_Episode(r, env_factory(dict(r.fields)), tokenizer) for _ in range(group_size)]
    try:
        for turn in range(max_turns):
            active = [i for i, e in enumerate(episodes) if e.finish is None]
            for i in list(active):
                e = episodes[i]
                if len(e.prompt) + len(e.tokens) >= row_tokens:
                    e.finish = "length"
                    while e.trained and not e.trained[-1]:  # a tool turn no model turn follows: not run, dropped
                        e.tokens.pop(), e.trained.pop(), e.logprobs.pop()
                    active.remove(i)
            if not active:
                break
            inputs = [episodes[i].prompt + episodes[i].tokens for i in active]
            limits = [min(max_new_tokens, row_tokens - len(x)) for x in inputs]
            turns = sample(engine, inputs, 1, max_new_tokens=limits, temperature=temperature, top_p=top_p,
                           stop_ids=stop_ids, seeds=[seed(i, turn) for i in active])
            for i, c in zip(active, turns):
                _take_reply(episodes[i], c, tokenizer, stop_ids)
            asking = [episodes[i] for i in active if episodes[i].finish is None]
            # process 0's environments answer for every process (the others' engines must see the same turns)
            answers = main_process_result(lambda: [e.env.step([dict(m) for m in e.conversation]).to_json()
                                                   for e in asking])
            for e, answer in zip(asking, answers):
                _take_answer(e, EnvTurn.from_json(answer), tokenizer, last_turn=turn == max_turns - 1)
    finally:
        for e in episodes:
            e.env.close()
    return [Completion(e.prompt, e.tokens, e.finish or "turns", np.asarray(e.logprobs, np.float32),
                       np.stack(e.routes).astype(np.int32) if e.routes else None, np.asarray(e.trained, bool),
                       e.reply, e.reward) for e in episodes]


def _take_reply(e: _Episode, c: Completion, tokenizer, stop_ids) -> None:
    """Add a sampled model turn ``c`` (on the episode's history) to episode ``e``: its tokens, and its message to
    the conversation unless it ran out of tokens (which ends the episode)."""
    if c.routes is not None:
        e.routes += list(c.routes[len(e.routes):])
    e.tokens += c.tokens
    e.trained += [True] * len(c.tokens)
    e.logprobs += list(c.logprobs)
    text = tokenizer.decode([t for t in c.tokens if t not in stop_ids])
    message = assistant_message(tokenizer, text)
    e.reply = message["content"]
    if c.finish == "length":  # out of tokens mid-turn: nothing to hand to the environment
        e.finish = "length"
        return
    e.conversation.append(message)


def _take_answer(e: _Episode, answer: EnvTurn, tokenizer, *, last_turn: bool) -> None:
    """Add the environment's ``answer`` to the model's last turn to episode ``e``: the end of the episode, or the
    tool turn and the next generation prompt (untrained tokens)."""
    if answer.done or not answer.messages:  # (the bundled environments are done when no tool was called)
        e.finish, e.reward = "stop", answer.reward
        return
    if last_turn:
        e.finish = "turns"
        return
    e.conversation += [dict(m) for m in answer.messages]
    more = continuation(tokenizer, e.conversation, e.tools)
    e.tokens += more
    e.trained += [False] * len(more)
    e.logprobs += [0.0] * len(more)


__all__ = ["assistant_message", "continuation", "run_episodes"]
