"""Chat fine-tuning data: conversations -> token ids and the mask of the tokens the loss trains.

A record (``train.data.format: chat``; JSONL, parquet or ArrayRecord, ``k3jax.data.sources.open_records``)
is an OpenAI-style conversation::

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str | [{"type": "text",
                   "text": str}, ...] | null, "name": str?,
                   "reasoning_content": str? (assistant), "tool_calls": [{"id": str?, "type": "function"?,
                   "function": {"name": str, "arguments": JSON str | object}}]? (assistant),
                   "tool_call_id": str? (tool)}, ...],
     "tools": [{...}, ...]?}

It is rendered the way the checkpoint is prompted (:func:`chat_prompt`, which serving uses too):

- a tokenizer with a chat format (``k3jax.tokenizer.Tokenizer``: the release's jinja template, K2 / Kimi
  Linear, or K3's XTML) renders it through ``apply_chat_template``;
- any other tokenizer (the byte tokenizer of the demo) gets the plain transcript of
  :func:`transcript_segments`: one ``role: content`` + :data:`END_OF_TURN` + newline per message, and
  ``assistant:`` as the generation prompt.

What the loss trains. An assistant turn's trained span is what the model has to generate after the
generation prompt: its reasoning and content as the format renders them, its tool calls and its
end-of-turn token (so the model learns to stop), not the role header, not system / user / tool turns.
``train.data.chat_loss``: ``assistant`` (every assistant turn), ``last_assistant`` (the last one),
``all`` (every token, as for plain text). Target convention of ``k3jax.data.pipeline``: the mask sits on
the *target*, i.e. position i is trained when ``ids[i + 1]`` is.

How the spans are found (never by diffing renders of the conversation's prefixes; the tests do that,
independently). Template formats: the generation prompt's tokens (the render with it minus the render
without it) are the assistant header; the k-th occurrence of the header in the rendered conversation
opens the k-th assistant turn, whose span runs from just after it to the first end-of-turn token
(``tokenizer.stop_ids``) inclusive. A template that renders assistant headers differently from its
generation prompt (e.g. K2's header carries a message's ``name``) is reported for that record. The
transcript marks its segments as it emits them.

Overflow (``train.data.chat_overflow``): a conversation of more than ``seq_len`` (input, target) pairs is
``truncate``-d to the longest prefix that fits and ends at a trained target, or ``drop``-ped; one with no
trained target (no assistant turn, or nothing trained fits) is skipped. :func:`scan_conversations`
counts these over the whole source when a run starts.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from k3jax.config import DataConfig
from k3jax.config.fields import check_choice, field_types
from k3jax.data.sources import bundled_chat_path, open_records
from k3jax.tokenizer import TextTokenizer

ROLES = ("system", "user", "assistant", "tool")

# The plain transcript (tokenizers without a chat format). ASCII "end of transmission": a single byte that
# ordinary text never holds, so it cannot be confused with content. The trained span of an assistant turn
# ends with it; a client stops on it (OpenAI ``stop=["\u0004"]``).
END_OF_TURN = "\x04"
GENERATION_PROMPT = "assistant:"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

NOT_TRAINED = -1  # the turn index of a token outside every assistant turn


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A validated record: messages (``None`` fields dropped, ``content`` always present) and tools."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    where: str  # "<file>: record <i>", for errors


# --- validation ---------------------------------------------------------------------------------------


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")
    for k, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{k}]: a content part must be {{'type': 'text', 'text': str}}, got {part!r}")


def tool_call_arguments(fn: Mapping, where: str = "function") -> Mapping:
    """A tool call's ``function.arguments`` as an object (OpenAI sends a JSON string; absent = ``{}``)."""
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.arguments: not valid JSON ({e})") from None
    if args is not None and not isinstance(args, Mapping):
        raise ValueError(f"{where}.arguments: must be a JSON object, got {type(args).__name__}")
    return args or {}


def _check_tool_call(call: Any, where: str) -> None:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: must be an object, got {type(call).__name__}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}.function: must be an object with a 'name', got {type(fn).__name__}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name: a tool call needs a function name, got {fn.get('name')!r}")
    tool_call_arguments(fn, f"{where}.function")
    for key in ("id", "type"):
        if call.get(key) is not None and not isinstance(call[key], str):
            raise ValueError(f"{where}.{key}: must be a string, got {type(call[key]).__name__}")


def parse_conversation(record: Any, where: str) -> Conversation:
    """A record -> :class:`Conversation`; a malformed one raises ``ValueError`` naming ``where`` (file and
    record) and the field."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object with a 'messages' list, got {type(record).__name__}")
    if "messages" not in record or record["messages"] is None:
        raise ValueError(f"{where}: no field 'messages'; fields: {sorted(record)}")
    raw = record["messages"]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: 'messages' must be a non-empty list, got {raw!r:.80}")
    messages = []
    for j, m in enumerate(raw):
        at = f"{where}: messages[{j}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{at}: must be an object, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}  # parquet structs hold every field, absent ones None
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{at}.role: unknown role {role!r}; one of {', '.join(ROLES)}")
        if "content" in m:
            _check_content(m["content"], f"{at}.content")
        elif role != "assistant":  # an assistant turn may be tool calls only
            raise ValueError(f"{at}.content: a {role} message needs content")
        m.setdefault("content", "")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if key in m and not isinstance(m[key], str):
                raise ValueError(f"{at}.{key}: must be a string, got {type(m[key]).__name__}")
        if role != "assistant":
            for key in ("tool_calls", "reasoning_content"):
                if key in m:
                    raise ValueError(f"{at}.{key}: only an assistant message has {key}")
        calls = m.get("tool_calls", [])
        if not isinstance(calls, list):
            raise ValueError(f"{at}.tool_calls: must be a list, got {type(calls).__name__}")
        for k, call in enumerate(calls):
            _check_tool_call(call, f"{at}.tool_calls[{k}]")
        messages.append(m)
    tools = record.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise ValueError(f"{where}: tools: must be a list of objects, got {tools!r:.80}")
        tools = tuple(tools) or None
    return Conversation(tuple(messages), tools, where)


# --- rendering ----------------------------------------------------------------------------------------


def has_chat_format(tokenizer) -> bool:
    """Whether the tokenizer renders chats itself (a jinja template or K3's XTML markers)."""
    return bool(getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_xtml", False))


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def transcript_segments(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, *,
                        add_generation_prompt: bool) -> list[tuple[str, int]]:
    """The plain transcript as ``(text, assistant turn index or NOT_TRAINED)`` segments: one message per
    line, each ending with ``<EOT>`` (:data:`END_OF_TURN`), the newline *before* a message (so nothing
    follows a turn's ``<EOT>`` but the next message)::

        tools: [...]<EOT>                        (when there are tools)
        system: ...<EOT>
        user: Quote Genesis 1:3<EOT>
        assistant: <think>...</think>And God said, ...<tool_call>{"name": ..., "arguments": ...}</tool_call><EOT>
        tool: ...<EOT>
        assistant:                               (the generation prompt)

    An assistant turn's trained segment is everything after ``assistant:`` up to and including
    ``<EOT>``. Content holding ``<EOT>`` is refused: the model would learn to stop inside it.
    """

    def body_of(field: str, body: str) -> str:
        if END_OF_TURN in body:
            raise ValueError(f"{field}: holds the transcript's end-of-turn marker {END_OF_TURN!r}")
        return body

    segments = []
    if tools:
        segments.append((f"tools: {body_of('tools', json.dumps(list(tools), ensure_ascii=False))}{END_OF_TURN}",
                         NOT_TRAINED))
    turn = 0
    for j, m in enumerate(messages):
        role, sep = m["role"], "\n" if segments else ""
        if role != "assistant":
            text = body_of(f"messages[{j}].content", _text(m.get("content") or ""))
            segments.append((f"{sep}{role}: {text}{END_OF_TURN}", NOT_TRAINED))
            continue
        body = ""
        if m.get("reasoning_content"):
            body += f"{THINK_OPEN}{m['reasoning_content']}{THINK_CLOSE}"
        body += _text(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            call = {"name": call["function"]["name"], "arguments": tool_call_arguments(call["function"])}
            body += f"{TOOL_CALL_OPEN}{json.dumps(call, ensure_ascii=False)}{TOOL_CALL_CLOSE}"
        segments.append((sep + GENERATION_PROMPT, NOT_TRAINED))
        segments.append((f" {body_of(f'messages[{j}]', body)}{END_OF_TURN}", turn))
        turn += 1
    if add_generation_prompt:
        segments.append((("\n" if segments else "") + GENERATION_PROMPT, NOT_TRAINED))
    return segments


def parse_transcript_reply(text: str) -> tuple[str | None, str, list[dict]]:
    """An assistant turn of the plain transcript (:func:`transcript_segments`' body, without ``<EOT>``) read back:
    (reasoning or None, content, OpenAI ``tool_calls``). A ``<tool_call>`` whose body is not a JSON object with
    a ``name`` stays in the content, as the model wrote it."""
    reasoning = None
    if text.startswith(THINK_OPEN) and THINK_CLOSE in text:
        reasoning, text = text[len(THINK_OPEN):].split(THINK_CLOSE, 1)
    content, calls, rest = "", [], text
    while TOOL_CALL_OPEN in rest:
        before, after = rest.split(TOOL_CALL_OPEN, 1)
        body, closed, rest = after.partition(TOOL_CALL_CLOSE)
        try:
            call = json.loads(body) if closed else None
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            content += before + TOOL_CALL_OPEN + body + closed
            continue
        content += before
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    return reasoning, content + rest, calls


def chat_prompt(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's reply starts: the tokenizer's own chat
    format when it has one, else the plain transcript (module docstring). Serving prompts with this, and
    training renders conversations the same way."""
    return render_chat(tokenizer, messages, tools, add_generation_prompt=True)


def render_chat(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, *,
                add_generation_prompt: bool) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat format (or the plain transcript), with or without
    the generation prompt after it."""
    if has_chat_format(tokenizer):
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tools=tools))
    ids: list[int] = []
    for text, _ in transcript_segments(messages, tools, add_generation_prompt=add_generation_prompt):
        ids.extend(tokenizer.encode(text))
    return ids


def _end_of_turn_ids(tokenizer) -> set[int]:
    stops = set(getattr(tokenizer, "stop_ids", ()) or ())
    if tokenizer.eos_id is not None:
        stops.add(tokenizer.eos_id)
    return stops


def reply_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant reply to a :func:`chat_prompt`: the chat format's end-of-turn tokens
    (``tokenizer.stop_ids`` and EOS), or the transcript's :data:`END_OF_TURN` (one byte for the byte
    tokenizer) — what a chat fine-tune trains the model to emit."""
    if has_chat_format(tokenizer):
        return tuple(sorted(_end_of_turn_ids(tokenizer)))
    ids = tokenizer.encode(END_OF_TURN)
    return tuple(ids) if len(ids) == 1 else tuple(sorted(_end_of_turn_ids(tokenizer)))


def _template_turns(tokenizer, conv: Conversation) -> tuple[list[int], np.ndarray]:
    """Ids of a conversation rendered by the tokenizer's chat format, and each token's assistant turn."""
    messages, tools = list(conv.messages), list(conv.tools) if conv.tools else None
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools))
    prompted = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools))
    header = prompted[len(ids):]
    if prompted[:len(ids)] != ids or not header:
        raise ValueError(f"{conv.where}: the chat template's generation prompt is not a suffix of the rendered "
                         "conversation, so its assistant turns cannot be located")
    stops = _end_of_turn_ids(tokenizer)
    if not stops:
        raise ValueError("the tokenizer has no end-of-turn token (stop_ids / eos): a chat template's assistant "
                         "turns cannot be delimited")
    turns = np.full(len(ids), NOT_TRAINED, np.int32)
    n, h, turn, i = len(ids), len(header), 0, 0
    while i + h <= n:
        if ids[i:i + h] != header:
            i += 1
            continue
        start = i + h
        end = next((j for j in range(start, n) if ids[j] in stops), None)
        if end is None:
            raise ValueError(f"{conv.where}: assistant turn {turn} has no end-of-turn token "
                             f"({sorted(stops)}) after its header")
        turns[start:end + 1] = turn
        turn, i = turn + 1, end + 1
    expected = sum(m["role"] == "assistant" for m in messages)
    if turn != expected:
        raise ValueError(f"{conv.where}: the chat template renders {turn} assistant header(s) "
                         f"{tokenizer.decode(header)!r} for {expected} assistant message(s) (a 'name' on an "
                         "assistant message, or a template whose history headers differ from its generation prompt)")
    return ids, turns


def render_conversation(tokenizer: TextTokenizer, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """``ids int32[n]`` of the whole conversation (no generation prompt) and ``turns int32[n]``: the index
    of the assistant turn whose trained span holds each token, :data:`NOT_TRAINED` elsewhere."""
    try:
        if has_chat_format(tokenizer):
            ids, turns = _template_turns(tokenizer, conv)
            return np.asarray(ids, np.int32), turns
        ids, turns = [], []
        for text, turn in transcript_segments(conv.messages, conv.tools, add_generation_prompt=False):
            piece = tokenizer.encode(text)
            ids.extend(piece)
            turns.extend([turn] * len(piece))
        return np.asarray(ids, np.int32), np.asarray(turns, np.int32)
    except ValueError as e:
        if str(e).startswith(conv.where):
            raise
        raise ValueError(f"{conv.where}: {e}") from e
    except Exception as e:  # a template's own error (jinja raise_exception, a missing key, ...)
        raise ValueError(f"{conv.where}: the chat template cannot render it: {type(e).__name__}: {e}") from e


def _check_setting(name: str, value: str) -> None:
    """``value`` is one of the choices of ``DataConfig.<name>`` (its ``Literal``: the one list of them)."""
    check_choice(value, field_types(DataConfig)[name], f"train.data.{name}")


def trained_tokens(turns: np.ndarray, chat_loss: str) -> np.ndarray:
    """Per token: whether ``chat_loss`` (``train.data.chat_loss``) trains it (``turns`` from
    :func:`render_conversation`)."""
    _check_setting("chat_loss", chat_loss)
    if chat_loss == "all":
        return np.ones(turns.shape, bool)
    if chat_loss == "assistant":
        return turns != NOT_TRAINED
    return (turns == turns.max()) & (turns != NOT_TRAINED)  # last_assistant


# --- examples for the packing pipeline ----------------------------------------------------------------

OUTCOMES = ("kept", "truncated", "dropped", "skipped")


def conversation_example(ids: np.ndarray, trained: np.ndarray, seq_len: int,
                         overflow: str) -> tuple[dict[str, np.ndarray] | None, str]:
    """Shifted pairs ``{"inputs", "targets", "loss_mask"}`` (``[n <= seq_len]``; the mask on the target) of
    one rendered conversation, and its outcome, one of :data:`OUTCOMES` (None for dropped / skipped).
    ``overflow``: ``train.data.chat_overflow``."""
    _check_setting("chat_overflow", overflow)
    inputs, targets, mask = ids[:-1], ids[1:], trained[1:]
    if not mask.any():
        return None, "skipped"
    outcome = "kept"
    if len(inputs) > seq_len:
        fits = np.nonzero(mask[:seq_len])[0]
        if overflow == "drop" or len(fits) == 0:
            return None, "dropped"
        cut = int(fits[-1]) + 1
        inputs, targets, mask, outcome = inputs[:cut], targets[:cut], mask[:cut], "truncated"
    return {"inputs": inputs, "targets": targets, "loss_mask": mask.astype(np.float32)}, outcome


class ConversationToPieces(grain.experimental.FlatMapTransform):
    """:class:`Conversation` -> ``[example]`` (one, or none when dropped / skipped): the chat counterpart of
    ``pipeline.DocumentToPieces``."""

    max_fan_out = 1

    def __init__(self, tokenizer: TextTokenizer, seq_len: int, chat_loss: str, overflow: str):
        self.tokenizer, self.seq_len, self.chat_loss, self.overflow = tokenizer, seq_len, chat_loss, overflow

    def example(self, conv: Conversation) -> tuple[dict[str, np.ndarray] | None, str]:
        ids, turns = render_conversation(self.tokenizer, conv)
        return conversation_example(ids, trained_tokens(turns, self.chat_loss), self.seq_len, self.overflow)

    def flat_map(self, conv: Conversation) -> list[dict[str, np.ndarray]]:
        example, _ = self.example(conv)
        return [] if example is None else [example]


# --- sources and the start-of-run scan ----------------------------------------------------------------


class Conversations:
    """Random-access :class:`Conversation`\\ s over a source of records (validated as they are read)."""

    def __init__(self, records):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Conversation:
        return parse_conversation(self.records[index], self.records.where(index))

    def __repr__(self) -> str:
        return f"Conversations({self.records!r})"


def open_conversations(source: str = "bundled") -> Conversations:
    """``train.data.source`` read as chat records; ``"bundled"`` is the shipped chat set
    (``k3jax/data/corpus/chat.jsonl``)."""
    return Conversations(open_records(str(bundled_chat_path()) if source == "bundled" else source))


@dataclasses.dataclass
class ChatCounts:
    """What :func:`scan_conversations` found: conversations by outcome and token counts of the kept ones."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0
    bad: int = 0  # invalid records skipped (train.data.bad_records=skip)
    tokens: int = 0  # (input, target) pairs of the kept and truncated examples
    trained: int = 0  # of which trained

    def summary(self) -> str:
        frac = self.trained / max(self.tokens, 1)
        return (f"{self.conversations} conversations: {self.kept} kept, {self.truncated} truncated, "
                f"{self.dropped} dropped (longer than seq_len), {self.skipped} skipped (no trained token)"
                + (f", {self.bad} invalid skipped (train.data.bad_records=skip)" if self.bad else "")
                + f"; {self.trained} of {self.tokens} tokens trained ({frac:.1%})")


def scan_conversations(conversations, to_pieces: ConversationToPieces,
                       indices: Sequence[int] | None = None) -> ChatCounts:
    """Render every conversation (of ``indices``) once and count the outcomes. Reading validates every
    record, so a malformed one stops the run at its start; one record is held at a time. ``conversations``
    may be a ``k3jax.data.sources.GuardedRecords`` skipping bad records (read as None, or rejected when
    they fail to render): those are counted as ``bad``."""
    counts = ChatCounts()
    for i in range(len(conversations)) if indices is None else indices:
        conv = conversations[int(i)]
        counts.conversations += 1
        try:
            example, outcome = (None, "bad") if conv is None else to_pieces.example(conv)
        except ValueError as e:
            if not hasattr(conversations, "reject"):
                raise
            conversations.reject(int(i), e)  # raises under bad_records=stop
            example, outcome = None, "bad"
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        if example is not None:
            counts.tokens += len(example["targets"])
            counts.trained += int(example["loss_mask"].sum())
    return counts


__all__ = ["END_OF_TURN", "GENERATION_PROMPT", "NOT_TRAINED", "OUTCOMES", "ROLES", "ChatCounts", "Conversation",
           "ConversationToPieces", "Conversations", "chat_prompt", "conversation_example", "has_chat_format",
           "open_conversations", "parse_conversation", "parse_transcript_reply", "render_chat", "render_conversation",
           "reply_stop_ids", "scan_conversations",
           "tool_call_arguments", "trained_tokens", "transcript_segments"]
