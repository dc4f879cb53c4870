"""Tool calls and reasoning in the chat API for a checkpoint in K3's format (XTML), through the
``openai`` client against a server whose engine is scripted (it "generates" a fixed turn, so no
model runs): ``tools`` and the history's tool calls / tool messages reach the prompt through the
chat format; the turn comes back as ``reasoning_content``, ``content`` and ``tool_calls`` (ids,
JSON arguments), whole or streamed as deltas; malformed markup comes back as plain content with
``finish_reason: stop``. Also the parser alone, fed in pieces."""

from __future__ import annotations

import json
import threading

import pytest

from k3jax.serving.assistant_reply import ReplyStream, parse_reply
from k3jax.serving.metrics import Metrics
from k3jax.tokenizer import CLOSE, OPEN, SEP, Tokenizer
from test_serving import client, running_server
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
        ids = self.tokenizer.encode(self.turn, allow_special=True)

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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3tok")
    write_tokenizer(path, k3=True)
    tokenizer = Tokenizer.from_dir(path)
    engine = ScriptedEngine(tokenizer)
    with running_server(engine, tokenizer=tokenizer) as url:
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
    from test_serving import post

    url, _, _ = served
    user = [{"role": "user", "content": "Hi"}]
    for body, field in [({"messages": user, "tools": [{"type": "function"}]}, "tools[0].function"),
                        ({"messages": user, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
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
