"""A K3 assistant turn parsed back into OpenAI's chat fields: ``reasoning_content``, ``content`` and
``tool_calls``, whole or as stream deltas.

After the generation prompt ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``
(``k3jax.tokenizer.render_xtml``) a turn reads::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="string|number|boolean|null|object|array"<|sep|>VALUE<|close|>argument<|sep|>...
     <|close|>call<|sep|>...<|close|>tools<|sep|>]<|close|>message<|sep|>

(the end-of-message token that follows is a stop token). String arguments are raw text, the others
JSON. Markup the grammar does not allow makes the rest of the turn plain content: a model's broken
output is returned, never an error.
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


def _call(name: str, body: str) -> dict | None:
    """An OpenAI tool call from a call element's name and body; None when the body is malformed."""
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
                    call = _call(m.group(1), m.group(2))
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


def _safe_prefix(text: str) -> int:
    """Length of ``text`` minus a tail that could begin a marker (``<|`` ... of OPEN / CLOSE / SEP)."""
    for k in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in _MARKERS):
            return len(text) - k
    return len(text)


def renders_xtml(tokenizer) -> bool:
    """Whether the tokenizer's chat format is K3's XTML (no jinja template), whose turns this module parses."""
    return bool(getattr(tokenizer, "has_xtml", False)) and not getattr(tokenizer, "chat_template", None)


@dataclasses.dataclass(frozen=True)
class Reply:
    reasoning: str | None
    content: str
    tool_calls: list
    malformed: bool


def parse_reply(text: str) -> Reply:
    """A whole turn's fields; a malformed turn is all content (no reasoning, no tool calls)."""
    stream = ReplyStream()
    events = stream.feed(text, final=True)
    if stream.malformed:
        return Reply(None, text, [], True)
    reasoning = "".join(v for k, v in events if k == "reasoning")
    return Reply(reasoning or None, "".join(v for k, v in events if k == "content"), stream.tool_calls, False)
