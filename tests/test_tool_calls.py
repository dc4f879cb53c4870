"""Tool calls and reasoning in the chat API for a checkpoint in K3's format (XTML) and one with a K2 /
Kimi Linear jinja template, through the ``openai`` client against a server whose engine is scripted
(it "generates" a fixed turn, so no model runs): ``tools`` and the history's tool calls / tool
messages reach the prompt through the chat format; the turn comes back as ``reasoning_content``,
``content`` and ``tool_calls`` (ids, JSON arguments), whole or streamed as deltas; malformed markup
comes back as plain content with ``finish_reason: stop``; ``tool_choice`` ``required`` and a named
function (prompted as each format allows, the named call checked); a byte-tokenizer chat reply ends
at the transcript's end-of-turn byte. Also the parsers alone, fed in pieces."""

from __future__ import annotations

import json
import threading

import pytest

from k3jax.data.chat import END_OF_TURN
from k3jax.serving.assistant_reply import K2ReplyStream, ReplyStream, parse_reply
from k3jax.serving.metrics import Metrics
from k3jax.tokenizer import CLOSE, OPEN, SEP, ByteTokenizer, Tokenizer
from test_chat_data import K2_SPECIALS, K2_TEMPLATE, tiktoken_tokenizer
from test_serving import client, post, running_server
from test_tokenizer import write_tokenizer

CALL = (f'{OPEN}call tool="get_weather" index="1"{SEP}{OPEN}argument key="city" type="string"{SEP}Paris'
        f'{CLOSE}argument{SEP}{OPEN}argument key="days" type="number"{SEP}3{CLOSE}argument{SEP}{CLOSE}call{SEP}')
TURN = (f"The user wants weather.{CLOSE}think{SEP}{OPEN}response{SEP}Checking.{CLOSE}response{SEP}"
        f"{OPEN}tools{SEP}{CALL}{CLOSE}tools{SEP}{CLOSE}message{SEP}<|end_of_msg|>")
PLAIN = f"Hm.{CLOSE}think{SEP}{OPEN}response{SEP}Hello!{CLOSE}response{SEP}{CLOSE}message{SEP}<|end_of_msg|>"
BROKEN = f"Hm.{CLOSE}think{SEP}{OPEN}tools{SEP}oops<|end_of_msg|>"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
K2_ARGS = '{"city": "Paris", "days": 3}'
K2_CALL = f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{K2_ARGS}<|tool_call_end|>"
K2_TURN = (f"<think>The user wants weather.</think>Checking.<|tool_calls_section_begin|>{K2_CALL}"
           "<|tool_calls_section_end|><|im_end|>")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "user", "content": "And Paris?"}]


class ScriptedEngine:
    """The engine's client side; every request "generates" the tokens of ``self.turn`` up to a stop token."""

    max_len, max_batch, max_queue = 4096, 4, 4

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.vocab_size, self.metrics = tokenizer, tokenizer.vocab_size, Metrics()
        self.turn, self.prompts = TURN, []

    def start(self):
        pass

    def stop(self):
        pass

    def submit(self, seq):
        self.prompts.append(seq.prompt)
        ids = (self.tokenizer.encode(self.turn, allow_special=True) if isinstance(self.tokenizer, Tokenizer)
               else self.tokenizer.encode(self.turn))

        def run():
            for t in ids:
                seq.generated.append(t)
                if t in seq.params.stop_ids:
                    break
                seq.on_token(t, None)
            seq.finish_reason = "stop"
            seq.on_finish("stop")
        threading.Thread(target=run, daemon=True).start()

    def cancel(self, seq, reason="cancelled"):
        pass

    def active_count(self):
        return 0

    def queue_length(self):
        return 0


def scripted_server(tokenizer):
    engine = ScriptedEngine(tokenizer)
    return engine, running_server(engine, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3tok")
    write_tokenizer(path, k3=True)
    tokenizer = Tokenizer.from_dir(path)
    engine, server = scripted_server(tokenizer)
    with server as url:
        yield url, engine, tokenizer


@pytest.fixture(scope="module")
def served_k2(tmp_path_factory):
    tokenizer = tiktoken_tokenizer(tmp_path_factory.mktemp("k2tok"), K2_SPECIALS, K2_TEMPLATE)
    engine, server = scripted_server(tokenizer)
    with server as url:
        yield url, engine, tokenizer


def test_tool_call_round_trip(served):
    url, engine, tokenizer = served
    engine.turn = TURN
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And Paris?"}]
    r = client(url).chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert '"name":"get_weather"' in prompt and 'argument key="city" type="string"' in prompt and "sunny" in prompt
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking." and choice.message.reasoning_content == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # streamed: reasoning and content deltas, the call in one delta, the same finish reason
    chunks = list(client(url).chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                                      stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants weather."
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_plain_and_malformed_turns(served):
    url, engine, _ = served
    c = client(url)
    engine.turn = PLAIN
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=50)
    assert r.choices[0].message.content == "Hello!" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    engine.turn = BROKEN
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                  max_tokens=50)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == BROKEN[:-len("<|end_of_msg|>")]
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                            max_tokens=50, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "oops" in "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_bad_tool_requests_are_400(served):
    url, _, _ = served
    user = [{"role": "user", "content": "Hi"}]
    for body, field in [({"messages": user, "tools": [{"type": "function"}]}, "tools[0].function"),
                        ({"messages": user, "tool_choice": "required"}, "tool_choice"),  # no tools
                        ({"messages": user, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                            "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"messages": user, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
                            {"function": {"name": "f", "arguments": "{not json"}}]}]}, "messages")]:
        status, reply, _ = post(url, "/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == field, (body, reply)


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_reply_parser_in_pieces(piece):
    turn = TURN[:-len("<|end_of_msg|>")]
    stream, events = ReplyStream(), []
    for end in range(piece, len(turn) + piece, piece):
        events += stream.feed(turn[:end])
    events += stream.feed(turn, final=True)
    assert "".join(v for k, v in events if k == "reasoning") == "The user wants weather."
    assert "".join(v for k, v in events if k == "content") == "Checking."
    assert [json.loads(v["function"]["arguments"]) for k, v in events if k == "tool_call"] == [{"city": "Paris",
                                                                                                "days": 3}]
    whole = parse_reply(turn)
    assert (whole.reasoning, whole.content, len(whole.tool_calls), whole.malformed) == (
        "The user wants weather.", "Checking.", 1, False)
    bad = parse_reply(CALL)  # markup inside the reasoning
    assert bad.malformed and bad.content == CALL and bad.tool_calls == []


def streamed(url: str, **kwargs):
    """(reasoning, content, tool calls, finish reason) of a streamed chat completion."""
    chunks = list(client(url).chat.completions.create(model="tiny", max_tokens=200, stream=True, **kwargs))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    return ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), calls, chunks[-1].choices[0].finish_reason)


def test_k2_tool_call_round_trip(served_k2):
    url, engine, tokenizer = served_k2
    engine.turn = K2_TURN
    r = client(url).chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=200)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}' in prompt
            and "sunny" in prompt and prompt.endswith("<|im_assistant|>assistant<|im_middle|>"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking." and choice.message.reasoning_content == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert call.id == "functions.get_weather:0" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    reasoning, content, calls, reason = streamed(url, messages=HISTORY, tools=TOOLS)
    assert (reasoning, content, reason) == ("The user wants weather.", "Checking.", "tool_calls")
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id == "functions.get_weather:0"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    engine.turn = "Hello!<|im_end|>"  # no tools called
    r = client(url).chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.content == "Hello!" and r.choices[0].finish_reason == "stop"
    engine.turn = "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0" \
                  "<|tool_call_argument_begin|>{not json<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    r = client(url).chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == engine.turn[:-len("<|im_end|>")]


def test_k2_required_and_named_tool_choice(served_k2):
    """K2's template has no tool_choice instruction: the turn is started inside the tools section (a
    named function: inside its call), and the rest the model writes completes the call."""
    url, engine, tokenizer = served_k2
    c = client(url)
    tools = [*TOOLS, OTHER_TOOL]
    engine.turn = f"{K2_CALL}<|tool_calls_section_end|><|im_end|>"
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=tools, tool_choice="required", max_tokens=200)
    assert tokenizer.decode(engine.prompts[-1]).endswith("<|im_middle|><|tool_calls_section_begin|>")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    named = {"type": "function", "function": {"name": "get_weather"}}
    engine.turn = f"{K2_ARGS}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=tools, tool_choice=named, max_tokens=200)
    assert tokenizer.decode(engine.prompts[-1]).endswith(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>")
    (call,) = r.choices[0].message.tool_calls
    assert call.id == "functions.get_weather:0" and json.loads(call.function.arguments)["city"] == "Paris"
    _, content, calls, reason = streamed(url, messages=HISTORY, tools=tools, tool_choice=named)
    assert reason == "tool_calls" and content == "" and [tc.function.name for tc in calls] == ["get_weather"]
    # a second call, of another function, breaks the named choice: the turn is returned as text
    engine.turn = (f"{K2_ARGS}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{{}}"
                   "<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=tools, tool_choice=named, max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "functions.get_time:1" in r.choices[0].message.content


def test_k3_required_and_named_tool_choice(served):
    """K3's template has a tool_choice=required instruction; a named function is checked on the reply."""
    url, engine, tokenizer = served
    c = client(url)
    engine.turn = TURN
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="required", max_tokens=200)
    assert "tool_choice=required" in tokenizer.decode(engine.prompts[-1])
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=200,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "tool_choice=required" in tokenizer.decode(engine.prompts[-1])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == \
        "get_weather"
    only_time = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="tiny", messages=HISTORY, tools=[*TOOLS, OTHER_TOOL], max_tokens=200,
                                  tool_choice=only_time)  # the scripted turn calls get_weather
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == TURN[:-len("<|end_of_msg|>")]
    _, content, calls, reason = streamed(url, messages=HISTORY, tools=[*TOOLS, OTHER_TOOL], tool_choice=only_time)
    assert reason == "stop" and not calls and "get_weather" in content


def test_byte_tokenizer_chat_stops_at_end_of_turn():
    """A chat reply from the byte tokenizer's transcript format ends at its end-of-turn byte (what a chat
    fine-tune emits), which a completion does not stop at; tool_choice needs a format with tool markup."""
    engine, server = scripted_server(ByteTokenizer())
    engine.turn = f"Hello{END_OF_TURN}more"
    with server as url:
        c = client(url)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=50)
        assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "stop"
        _, content, _, reason = streamed(url, messages=[{"role": "user", "content": "hi"}])
        assert content == "Hello" and reason == "stop"
        r = c.completions.create(model="tiny", prompt="hi", max_tokens=50)
        assert r.choices[0].text == engine.turn
        status, reply, _ = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "tools": TOOLS, "tool_choice": "required"})
        assert status == 400 and reply["error"]["param"] == "tool_choice" and "markup" in reply["error"]["message"]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_k2_reply_parser_in_pieces(piece):
    turn = K2_TURN[:-len("<|im_end|>")] + "\n"
    stream, events = K2ReplyStream(), []
    for end in range(piece, len(turn) + piece, piece):
        events += stream.feed(turn[:end])
    events += stream.feed(turn, final=True)
    assert "".join(v for k, v in events if k == "reasoning") == "The user wants weather."
    assert "".join(v for k, v in events if k == "content") == "Checking."
    assert [v["function"]["arguments"] for k, v in events if k == "tool_call"] == [K2_ARGS]
    plain = parse_reply("a < b <think> c", K2ReplyStream())
    assert (plain.content, plain.reasoning, plain.malformed) == ("a < b <think> c", None, False)
    bad = parse_reply("x<|tool_calls_section_begin|>oops", K2ReplyStream())
    assert bad.malformed and bad.content == "x<|tool_calls_section_begin|>oops"
