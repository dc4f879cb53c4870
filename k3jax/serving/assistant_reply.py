"""An assistant turn parsed back into OpenAI's chat fields: ``reasoning_content``, ``content`` and
``tool_calls``, whole or as stream deltas, for two chat formats: K3's (XTML, :class:`ReplyStream`) and
K2 / Kimi Linear's jinja template (:class:`K2ReplyStream`, below).

After the generation prompt ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``
(``k3jax.tokenizer.render_xtml``) a turn reads::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="string|number|boolean|null|object|array"<|sep|>VALUE<|close|>argument<|sep|>...
     <|close|>call<|sep|>...<|close|>tools<|sep|>]<|close|>message<|sep|>

(the end-of-message token that follows is a stop token). String arguments are raw text, the others
JSON. Markup the grammar does not allow makes the rest of the turn plain content: a model's broken
output is returned, never an error.

K2 / Kimi Linear (a jinja template that renders tool calls in K2's markup; the generation prompt ends
with ``<|im_assistant|>assistant<|im_middle|>``, the turn with ``<|im_end|>``, a stop token)::

    [<think>REASONING</think>]CONTENT[<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...
     <|tool_calls_section_end|>]

(whitespace allowed between the section's parts, as vLLM's ``kimi_k2`` parser reads it); a call's id
is its ``functions.NAME:IDX``, which K2's template writes back in the history.

``tool_choice``: a turn that must call tools is prompted by the format's own means
(:func:`forced_prefix`): K3's template has a ``tool_choice=required`` instruction; K2's has none, so
its turn is started inside the tools section (for a named function, inside that function's call).
A parser made with ``only=NAME`` treats a call of any other function as malformed markup.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from k3jax.tokenizer import CLOSE, OPEN, SEP

_THINK_END = f"{CLOSE}think{SEP}"
_RESPONSE_START = f"{OPEN}response{SEP}"
_RESPONSE_END = f"{CLOSE}response{SEP}"
_TOOLS_START = f"{OPEN}tools{SEP}"
_TOOLS_END = f"{CLOSE}tools{SEP}"
_MESSAGE_END = f"{CLOSE}message{SEP}"
_CALL = re.compile(re.escape(OPEN) + r'call tool="([^"]*)" index="\d+"' + re.escape(SEP) + "(.*?)"
                   + re.escape(f"{CLOSE}call{SEP}"), re.S)
_ARGUMENT = re.compile(re.escape(OPEN) + r'argument key="([^"]*)" type="(string|number|boolean|null|object|array)"'
                       + re.escape(SEP) + "(.*?)" + re.escape(f"{CLOSE}argument{SEP}"), re.S)
_MARKERS = (OPEN, CLOSE, SEP)
# what may come next in each state between the text parts, and the state it leads to
_NEXT = {"between": {_RESPONSE_START: "response"}, "after": {_TOOLS_START: "tools", _MESSAGE_END: "done"},
         "tools": {_TOOLS_END: "after"}}


def _unescape(attr: str) -> str:
    return attr.replace("&quot;", '"').replace("&amp;", "&")


def _call(name: str, body: str, only: str | None = None) -> dict | None:
    """An OpenAI tool call from a call element's name and body; None when the body is malformed (or the
    call is not of function ``only``)."""
    if only is not None and _unescape(name) != only:
        return None
    args, end = {}, 0
    for m in _ARGUMENT.finditer(body):
        if m.start() != end:
            return None
        key, kind, raw = _unescape(m.group(1)), m.group(2), m.group(3)
        try:
            args[key] = raw if kind == "string" else json.loads(raw)
        except json.JSONDecodeError:
            return None
        end = m.end()
    if end != len(body):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": _unescape(name), "arguments": json.dumps(args, ensure_ascii=False)}}


@dataclasses.dataclass
class ReplyStream:
    """Incremental parse of a turn's text (special tokens spelled out): ``feed(text so far)`` ->
    events ``("reasoning" | "content", text delta)`` and ``("tool_call", call dict)``. Text is only
    handed out once no marker can still begin inside it."""
    state: str = "think"  # think -> between -> response -> after -> tools -> done; "plain" when malformed
    pos: int = 0  # characters of the text consumed
    tool_calls: list = dataclasses.field(default_factory=list)
    malformed: bool = False
    only: str | None = None  # the one function the turn may call (tool_choice naming it)

    def feed(self, text: str, final: bool = False) -> list[tuple[str, object]]:
        """Events for what ``text`` (the whole turn so far) adds; ``final``: the turn has ended."""
        events: list[tuple[str, object]] = []
        while True:
            rest = text[self.pos:]
            if self.state in ("think", "response"):
                kind = "reasoning" if self.state == "think" else "content"
                closing = _THINK_END if self.state == "think" else _RESPONSE_END
                marker = min((i for i in (rest.find(m) for m in _MARKERS) if i >= 0), default=-1)
                if marker < 0:  # plain text so far; hold back what may begin a marker
                    body = rest if final else rest[:_safe_prefix(rest)]
                    self._emit(events, kind, body)
                    self.pos += len(body)
                    return events
                if not rest.startswith(closing, marker):
                    if final or not closing.startswith(rest[marker:]):
                        return self._plain(events, text, final)
                    self._emit(events, kind, rest[:marker])  # the closing markup is still arriving
                    self.pos += marker
                    return events
                self._emit(events, kind, rest[:marker])
                self.pos += marker + len(closing)
                self.state = "between" if self.state == "think" else "after"
            elif self.state in ("between", "after", "tools"):
                if self.state == "tools" and (m := _CALL.match(rest)):
                    call = _call(m.group(1), m.group(2), self.only)
                    if call is None:
                        return self._plain(events, text, final)
                    self.tool_calls.append(call)
                    events.append(("tool_call", call))
                    self.pos += m.end()
                    continue
                expected = _NEXT[self.state]
                hit = next((e for e in expected if rest.startswith(e)), None)
                if hit is not None:
                    self.pos += len(hit)
                    self.state = expected[hit]
                    continue
                call_open = OPEN + "call"
                pending = any(e.startswith(rest) for e in expected) or (
                    self.state == "tools" and (rest.startswith(call_open) or call_open.startswith(rest)))
                if not rest or (pending and not final):
                    return events
                return self._plain(events, text, final)
            elif self.state == "done":
                return self._plain(events, text, final) if rest else events
            else:  # plain: everything after the break is content
                self._emit(events, "content", rest)
                self.pos = len(text)
                return events

    def _plain(self, events, text, final):
        self.state, self.malformed = "plain", True
        return events + self.feed(text, final)

    @staticmethod
    def _emit(events, kind, delta):
        if delta:
            events.append((kind, delta))


def _safe_prefix(text: str, markers=_MARKERS) -> int:
    """Length of ``text`` minus a tail that could begin a marker (``<|`` ... of OPEN / CLOSE / SEP)."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return len(text)


K2_THINK, K2_THINK_END = "<think>", "</think>"
K2_SECTION, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL, K2_ARGUMENTS, K2_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_K2_CALL = re.compile(r"\s*" + re.escape(K2_CALL) + r"\s*((?:functions\.)?([^\s:<]+):\d+)\s*" + re.escape(K2_ARGUMENTS)
                      + "(.*?)" + re.escape(K2_CALL_END), re.S)
_K2_SECTION_END = re.compile(r"\s*" + re.escape(K2_SECTION_END))


@dataclasses.dataclass
class K2ReplyStream:
    """:class:`ReplyStream` for K2's markup (module docstring): the same ``feed`` events, ``tool_calls``,
    ``malformed`` and ``only``."""
    state: str = "start"  # start -> [think ->] content -> [section -> after]; "plain" when malformed
    pos: int = 0
    tool_calls: list = dataclasses.field(default_factory=list)
    malformed: bool = False
    only: str | None = None

    def feed(self, text: str, final: bool = False) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        while True:
            rest = text[self.pos:]
            if self.state == "start":
                if rest.startswith(K2_THINK):
                    self.pos += len(K2_THINK)
                    self.state = "think"
                    continue
                if not final and K2_THINK.startswith(rest):  # "<thi..." may still become the tag
                    return events
                self.state = "content"
            elif self.state in ("think", "content"):
                kind, closing = ("reasoning", K2_THINK_END) if self.state == "think" else ("content", K2_SECTION)
                at = rest.find(closing)
                if at < 0:
                    body = rest if final else rest[:_safe_prefix(rest, (closing,))]
                    ReplyStream._emit(events, kind, body)
                    self.pos += len(body)
                    return events
                ReplyStream._emit(events, kind, rest[:at])
                self.pos += at + len(closing)
                self.state = "content" if self.state == "think" else "section"
            elif self.state == "section":
                if m := _K2_CALL.match(rest):
                    call = self._call(m)
                    if call is None:
                        return self._plain(events, text, final)
                    self.tool_calls.append(call)
                    events.append(("tool_call", call))
                    self.pos += m.end()
                    continue
                if m := _K2_SECTION_END.match(rest):
                    self.pos += m.end()
                    self.state = "after"
                    continue
                head = rest.lstrip()
                pending = (K2_SECTION_END.startswith(head) or K2_CALL.startswith(head)
                           or (head.startswith(K2_CALL) and K2_CALL_END not in head))
                if final or not pending:
                    return self._plain(events, text, final)
                return events
            elif self.state == "after":  # only whitespace may follow the section
                return self._plain(events, text, final) if rest.strip() else events
            else:  # plain
                ReplyStream._emit(events, "content", rest)
                self.pos = len(text)
                return events

    def _call(self, m: re.Match) -> dict | None:
        call_id, name, raw = m.group(1), m.group(2), m.group(3).strip()
        if self.only is not None and name != self.only:
            return None
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            return None
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}

    def _plain(self, events, text, final):
        self.state, self.malformed = "plain", True
        return events + self.feed(text, final)


def renders_xtml(tokenizer) -> bool:
    """Whether the tokenizer's chat format is K3's XTML (no jinja template), whose turns this module parses."""
    return bool(getattr(tokenizer, "has_xtml", False)) and not getattr(tokenizer, "chat_template", None)


def renders_k2(tokenizer) -> bool:
    """Whether the tokenizer's chat format is a jinja template in K2's tool-call markup (K2, Kimi Linear)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return K2_SECTION in template and K2_SECTION in (getattr(tokenizer, "special_tokens", None) or {})


def reply_stream(tokenizer, only: str | None = None) -> ReplyStream | K2ReplyStream | None:
    """A fresh parser of the tokenizer's chat format's turns (None: a format whose turns are plain text)."""
    if renders_xtml(tokenizer):
        return ReplyStream(only=only)
    if renders_k2(tokenizer):
        return K2ReplyStream(only=only)
    return None


def forced_prefix(tokenizer, tool_choice: str | None, name: str | None = None) -> tuple[dict, str]:
    """How a turn that must call a tool (``tool_choice`` ``required``, or ``function`` with ``name``) is
    prompted in the tokenizer's chat format: (extra chat-template arguments, text that starts the
    turn: appended to the prompt and read back as the turn's beginning). ValueError for a format that
    has no tool markup."""
    if tool_choice not in ("required", "function"):
        return {}, ""
    if renders_xtml(tokenizer):  # the template's instruction; a named call is checked when parsed
        return {"tool_choice": "required"}, ""
    if renders_k2(tokenizer):
        if name is None:
            return {}, K2_SECTION
        return {}, f"{K2_SECTION}{K2_CALL}functions.{name}:0{K2_ARGUMENTS}"
    raise ValueError("this chat format has no tool-call markup, so tool_choice 'required' or a named function "
                     "cannot be honoured")


@dataclasses.dataclass(frozen=True)
class Reply:
    reasoning: str | None
    content: str
    tool_calls: list
    malformed: bool


def parse_reply(text: str, stream: ReplyStream | K2ReplyStream | None = None) -> Reply:
    """A whole turn's fields (``stream``: a fresh parser, default K3's); a malformed turn is all content
    (no reasoning, no tool calls)."""
    stream = stream if stream is not None else ReplyStream()
    events = stream.feed(text, final=True)
    if stream.malformed:
        return Reply(None, text, [], True)
    reasoning = "".join(v for k, v in events if k == "reasoning")
    return Reply(reasoning or None, "".join(v for k, v in events if k == "content"), stream.tool_calls, False)
