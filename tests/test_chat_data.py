"""Chat fine-tuning data (k3jax/data/chat.py): the trained spans of K3 XTML, a K2-style jinja template and the
byte transcript against spans found independently (rendering the conversation prefix by prefix and diffing);
the mask through packing; the loss variants; overflow; skipped records; bad records naming file, record and
field; the show command; an all-masked batch; a short training run on chat data."""

import base64
import json
import math
import re

import numpy as np
import pytest

from k3jax.config import ConfigError, DataConfig, TrainConfig, load_config
from k3jax.data import chat
from k3jax.data.chat import (END_OF_TURN, NOT_TRAINED, ConversationToPieces, conversation_example,
                             open_conversations, parse_conversation, render_conversation, scan_conversations,
                             trained_tokens)
from k3jax.data.pipeline import batch_summary, make_train_dataset
from k3jax.tokenizer import ByteTokenizer

pytest.importorskip("tiktoken")
from k3jax.tokenizer import Tokenizer  # noqa: E402

# system, user, assistant with reasoning and a tool call, the tool's result, a final assistant turn
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "weather", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny and 21 C.", "reasoning_content": "Report it."},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
}

# A K2-style template written for this test (K2's layout: role headers <|im_assistant|>assistant<|im_middle|>,
# <|im_end|> ends every message, reasoning kept in <think> only after the last user message, tool calls in a
# section of their own, a default system message).
K2_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
    "{%- endif -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m.get('name') or m['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for tc in m['tool_calls'] -%}"
    "<|tool_call_begin|>functions.{{ tc['function']['name'] }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
    "{{ tc['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}## Return of {{ m.get('tool_call_id') }}{{ '\\n' }}{{ m['content'] }}"
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
K2_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_system|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
K3_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]


def tiktoken_tokenizer(path, specials, template=None) -> Tokenizer:
    """A byte-level tiktoken BPE (a few merges) with the given special tokens (release file layout)."""
    ranks = {bytes([i]): i for i in range(256)}
    for m in (b"th", b"the", b"in", b"er", b" t", b" the"):
        ranks[m] = len(ranks)
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    tc = {"added_tokens_decoder": {str(n + i): {"content": s, "special": True} for i, s in enumerate(specials)},
          "bos_token": "[BOS]", "eos_token": "[EOS]"}
    if template:
        tc["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return Tokenizer.from_dir(path)


@pytest.fixture(params=["xtml", "jinja", "transcript"])
def tokenizer(request, tmp_path):
    if request.param == "xtml":
        return tiktoken_tokenizer(tmp_path, K3_SPECIALS)
    if request.param == "jinja":
        return tiktoken_tokenizer(tmp_path, K2_SPECIALS, K2_TEMPLATE)
    return ByteTokenizer()


def _prompt_ids(tok, messages, tools, add_generation_prompt):
    """The format's own rendering of a (prefix of a) conversation, as a client would build it."""
    if chat.has_chat_format(tok):
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    return tok.encode("".join(t for t, _ in chat.transcript_segments(
        messages, tools, add_generation_prompt=add_generation_prompt)))


def _spans_by_prefix_diff(tok, messages, tools) -> np.ndarray:
    """The reference: assistant message j's span is render(messages[:j+1]) minus render(messages[:j]) + the
    generation prompt; each prefix render must be a prefix of the whole conversation's."""
    full = _prompt_ids(tok, messages, tools, False)
    turns, turn = np.full(len(full), NOT_TRAINED), 0
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _prompt_ids(tok, messages[:j], tools, True)
        after = _prompt_ids(tok, messages[:j + 1], tools, False)
        assert after[:len(before)] == before and full[:len(after)] == after
        turns[len(before):len(after)] = turn
        turn += 1
    return turns


def test_trained_spans_match_prefix_by_prefix_rendering(tokenizer):
    conv = parse_conversation(CONVERSATION, "conv")
    ids, turns = render_conversation(tokenizer, conv)
    want = _spans_by_prefix_diff(tokenizer, list(conv.messages), list(conv.tools))
    np.testing.assert_array_equal(turns, want)
    np.testing.assert_array_equal(ids, _prompt_ids(tokenizer, list(conv.messages), list(conv.tools), False))
    # what the spans hold: reasoning, content, the tool call and the end-of-turn token; no user / tool text
    first, second = (tokenizer.decode(ids[turns == k].tolist()) for k in (0, 1))
    untrained = tokenizer.decode(ids[turns == NOT_TRAINED].tolist())
    assert "I should call the tool." in first and "Let me look." in first and "Paris" in first
    assert "Report it." in second and second.endswith(("<|end_of_msg|>", "<|im_end|>", END_OF_TURN))
    assert "It is sunny and 21 C." in second
    assert "What is the weather" in untrained and "sunny, 21 C" in untrained and "You are terse." in untrained
    assert not any(s in first + second for s in ("What is the weather", "sunny, 21 C", "You are terse."))


def test_serving_prompt_is_the_training_rendering():
    from k3jax.serving import text

    assert text.chat_prompt is chat.chat_prompt
    conv = parse_conversation(CONVERSATION, "conv")
    ids, turns = render_conversation(ByteTokenizer(), conv)
    prompt = chat.chat_prompt(ByteTokenizer(), conv.messages[:4], conv.tools)
    start = int(np.nonzero(turns == 1)[0][0])  # the final turn starts where the served prompt ends
    assert ids[:start].tolist() == prompt and bytes(prompt).endswith(b"\nassistant:")
    assert bytes(ids[turns == 1].tolist()) == b" <think>Report it.</think>It is sunny and 21 C." + END_OF_TURN.encode()


def test_loss_variants():
    conv = parse_conversation(CONVERSATION, "conv")
    ids, turns = render_conversation(ByteTokenizer(), conv)
    every, last, whole = (trained_tokens(turns, v) for v in ("assistant", "last_assistant", "all"))
    np.testing.assert_array_equal(every, turns >= 0)
    np.testing.assert_array_equal(last, turns == 1)
    assert whole.all() and 0 < last.sum() < every.sum() < len(ids)
    example, outcome = conversation_example(ids, every, 10_000, "truncate")
    assert outcome == "kept"
    np.testing.assert_array_equal(example["inputs"], ids[:-1])
    np.testing.assert_array_equal(example["targets"], ids[1:])
    np.testing.assert_array_equal(example["loss_mask"], every[1:])  # the mask sits on the target
    with pytest.raises(ConfigError, match="train.data.chat_loss: must be one of"):
        trained_tokens(turns, "assistants")
    with pytest.raises(ConfigError, match="train.data.chat_overflow: must be one of"):
        conversation_example(ids, every, 10, "split")
    with pytest.raises(ConfigError, match="train.data.chat_loss: applies to chat data only"):
        load_config("tiny", ["train.data.chat_loss=all"])
    with pytest.raises(ConfigError, match="train.data.chat_overflow: must be one of"):
        load_config("tiny", ["train.data.format=chat", "train.data.chat_overflow=split"])


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _qa(q, a, system=None):
    return {"messages": ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _cfg(source, seq_len=64, batch=2, **data) -> TrainConfig:
    data = {"format": "chat", "eval_fraction": 0.0, **data}
    return TrainConfig(batch_size=batch, seq_len=seq_len, data=DataConfig(source=str(source), **data))


def test_overflow_truncate_and_drop_and_skipped_records(tmp_path, capsys):
    records = [_qa("hi", "hello"),                                       # fits
               _qa("x" * 10, "a long answer " * 4),                     # longer than 40: truncated / dropped
               _qa("y" * 50, "late"),                                    # no trained token fits in 40
               {"messages": [{"role": "user", "content": "no reply"}]}]  # nothing to train: skipped
    path = _write_jsonl(tmp_path / "c.jsonl", records)
    convs = open_conversations(str(path))
    tok = ByteTokenizer()
    truncate = scan_conversations(convs, ConversationToPieces(tok, 40, "assistant", "truncate"))
    drop = scan_conversations(convs, ConversationToPieces(tok, 40, "assistant", "drop"))
    assert (truncate.kept, truncate.truncated, truncate.dropped, truncate.skipped) == (1, 1, 1, 1)
    assert (drop.kept, drop.truncated, drop.dropped, drop.skipped) == (1, 0, 2, 1)
    # truncation keeps the longest prefix that fits and ends at a trained target
    ids, turns = render_conversation(tok, convs[1])
    example, outcome = ConversationToPieces(tok, 40, "assistant", "truncate").example(convs[1])
    n = len(example["inputs"])
    assert outcome == "truncated" and n == 40 and example["loss_mask"][-1] == 1
    np.testing.assert_array_equal(example["targets"], ids[1:n + 1])
    assert truncate.tokens == 40 + len(render_conversation(tok, convs[0])[0]) - 1
    # the run reports the scan at its start
    make_train_dataset(_cfg(path, seq_len=40))
    out = capsys.readouterr().out
    assert "4 conversations: 1 kept, 1 truncated, 1 dropped" in out and "1 skipped (no trained token)" in out


def test_a_split_without_a_trained_token_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "only a question"}]}] * 3)
    with pytest.raises(ValueError, match="no conversation of the train split has a trained token"):
        make_train_dataset(_cfg(path))


def test_packed_rows_keep_each_conversations_mask(tmp_path):
    r = np.random.default_rng(0)
    records = [_qa(f"q{i} " + "w" * int(r.integers(1, 20)), f"a{i} " + "v" * int(r.integers(1, 30)),
                   system="sys" if i % 3 == 0 else None) for i in range(40)]
    path = _write_jsonl(tmp_path / "c.jsonl", records)
    tok, seq = ByteTokenizer(), 96
    to_pieces = ConversationToPieces(tok, seq, "assistant", "truncate")
    convs = open_conversations(str(path))
    want = {}
    for i in range(len(convs)):
        ex, _ = to_pieces.example(convs[i])
        want[bytes(ex["inputs"].tolist())] = ex
    ds = make_train_dataset(_cfg(path, seq_len=seq, batch=4, eval_fraction=0.0), tok)
    seen, packed_rows = 0, 0
    for b in [next(it) for it in [iter(ds)] for _ in range(6)]:
        for row in range(4):
            seg = b["segment_ids"][row]
            packed_rows += seg.max() > 1
            assert np.all(b["loss_mask"][row][seg == 0] == 0)
            for s in np.unique(seg[seg > 0]):
                where = seg == s
                ex = want[bytes(b["tokens"][row][where].tolist())]
                np.testing.assert_array_equal(b["targets"][row][where], ex["targets"])
                np.testing.assert_array_equal(b["loss_mask"][row][where], ex["loss_mask"])
                np.testing.assert_array_equal(b["positions"][row][where], np.arange(where.sum()))
                seen += 1
        s = batch_summary(b)
        assert 0 < s["trained_tokens"] < s["tokens"]
    assert seen > 24 and packed_rows > 0


def test_eval_fraction_holds_out_conversations(tmp_path):
    records = [_qa(f"question {i}", f"answer {i}") for i in range(60)]
    path = _write_jsonl(tmp_path / "c.jsonl", records)
    cfg = _cfg(path, seq_len=64, batch=4, eval_fraction=0.2)
    train_q, eval_q = set(), set()
    for split, found in (("train", train_q), ("eval", eval_q)):
        ds = make_train_dataset(cfg, split=split)
        batches = list(ds) if split == "eval" else [next(it) for it in [iter(ds)] for _ in range(4)]
        for b in batches:
            text = bytes(b["tokens"][b["segment_ids"] > 0].tolist()).decode()
            found.update(re.findall(r"user: question \d+", text))
            assert bytes(b["targets"][b["loss_mask"] > 0].tolist()).count(END_OF_TURN.encode()) >= 1
    assert len(eval_q) == 8 and len(train_q) > 8 and not train_q & eval_q  # eval: 8 of the 60, all read


BAD_RECORDS = [
    ({"conversation": []}, "no field 'messages'; fields: \\['conversation'\\]"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages\\[0\\].role: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages\\[0\\].content: must be a string"),
    ({"messages": [{"role": "user"}]}, "messages\\[0\\].content: a user message needs content"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages\\[0\\].content\\[0\\]: a content part"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages\\[0\\].tool_calls\\[0\\].function.name: a tool call needs a function name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages\\[0\\].tool_calls\\[0\\].function.arguments: not valid JSON"),
    ({"messages": [{"role": "user", "content": "q", "reasoning_content": "r"}]},
     "messages\\[0\\].reasoning_content: only an assistant message"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": "f"}, "tools: must be a list of objects"),
    ({"messages": [{"role": "user", "content": "a\x04b"}, {"role": "assistant", "content": "c"}]},
     "messages\\[0\\].content: holds the transcript's end-of-turn marker"),
    ("[1, 2]", "expected a JSON object with a 'messages' list"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("record, message", BAD_RECORDS)
def test_bad_records_name_file_record_and_field(tmp_path, record, message):
    path = _write_jsonl(tmp_path / "chat.jsonl", [_qa("a", "b"), "", _qa("c", "d"), record])
    with pytest.raises(ValueError, match=f"{path}: record 2 \\(line 4\\): {message}"):
        make_train_dataset(_cfg(path))


def test_parquet_and_arrayrecord_records(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    ar = pytest.importorskip("array_record.python.array_record_module")
    records = [CONVERSATION, _qa("q", "a", system="s")]
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in records]), tmp_path / "c.parquet")
    w = ar.ArrayRecordWriter(str(tmp_path / "c.arrayrecord"), "group_size:1")
    for r in records:
        w.write(json.dumps(r).encode())
    w.close()
    want = [render_conversation(ByteTokenizer(), parse_conversation({"messages": r["messages"]}, "x"))[0]
            for r in records]
    parquet = open_conversations(str(tmp_path / "c.parquet"))
    # parquet rows hold every struct field (None where a message has none): absent, not an error
    for i in range(2):
        np.testing.assert_array_equal(render_conversation(ByteTokenizer(), parquet[i])[0], want[i])
    arrayrecord = open_conversations(str(tmp_path / "c.arrayrecord"))
    assert arrayrecord[0].tools == tuple(CONVERSATION["tools"])
    np.testing.assert_array_equal(render_conversation(ByteTokenizer(), arrayrecord[1])[0], want[1])
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "bot", "content": "x"}]}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet: record 0 \\(row 0\\): messages\\[0\\].role: unknown role"):
        open_conversations(str(tmp_path / "bad.parquet"))[0]


def test_template_turns_that_cannot_be_located_are_reported(tmp_path):
    tok = tiktoken_tokenizer(tmp_path, K2_SPECIALS, K2_TEMPLATE)
    named = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "name": "bot", "content": "a"}]}
    with pytest.raises(ValueError, match="here: the chat template renders 0 assistant header"):
        render_conversation(tok, parse_conversation(named, "here"))


def test_bundled_chat_set_and_show_command(capsys, tmp_path):
    from k3jax.data.show import main

    convs = open_conversations("bundled")
    assert len(convs) >= 300
    counts = scan_conversations(convs, ConversationToPieces(ByteTokenizer(), 320, "assistant", "truncate"))
    assert counts.kept == len(convs) and counts.skipped == 0  # every conversation fits 320 bytes
    assert main(["train.data.format=chat", "train.seq_len=256", "-n", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "chat data bundled (train, chat_loss=assistant" in out and "conversations:" in out
    assert out.count("--- train example") == 2
    assert "\nassistant:[[ " in out and "␄]]" in out and "user: " in out
    assert main(["train.data.format=chat", "-n", "1", "--color", "always"]) == 0
    assert "\x1b[32;1m" in capsys.readouterr().out
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    assert main(["train.data.format=chat", f"train.data.source={bad}"]) == 1
    assert f"error: {bad}: record 0 (line 1): messages[0].role: unknown role 'bot'" in capsys.readouterr().err


@pytest.mark.usefixtures("fast_xla_test")
def test_an_all_masked_batch_gives_zero_loss_and_a_finite_update():
    import jax
    from flax import nnx

    from k3jax.sharding import make_mesh
    from k3jax.training.step import init_train_state, make_train_step

    cfg = load_config("tiny", ["model.num_layers=1", "train.seq_len=8", "train.batch_size=2"])
    state = init_train_state(cfg, make_mesh(cfg.mesh))
    graphdef, st = nnx.split(state)
    before = jax.tree.map(np.asarray, nnx.state(state.model, nnx.Param))
    batch = {"tokens": np.ones((2, 8), np.int32), "segment_ids": np.ones((2, 8), np.int32),
             "positions": np.tile(np.arange(8, dtype=np.int32), (2, 1)), "targets": np.ones((2, 8), np.int32),
             "loss_mask": np.zeros((2, 8), np.float32)}
    st, metrics = make_train_step(graphdef, cfg)(st, batch)
    assert float(metrics["loss"]) == 0.0 and float(metrics["tokens"]) == 0.0 and bool(metrics["finite"])
    assert float(metrics["grad_norm"]) == 0.0
    after = nnx.state(nnx.merge(graphdef, st).model, nnx.Param)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after))
    assert jax.tree.structure(before) == jax.tree.structure(after)


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_training_on_chat_data_logs_the_trained_fraction(tmp_path):
    from k3jax.training.run_log import read_metrics
    from k3jax.training.trainer import train

    records = [_qa(f"Quote verse {i}.", f"And it was so, {i} times.", system="Be brief." if i % 2 else None)
               for i in range(24)]
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = load_config("tiny", ["model.num_layers=1", "train.seq_len=64", "train.batch_size=2", "train.steps=2",
                               "train.log_every=1", "train.data.format=chat", f"train.data.source={path}",
                               "train.data.eval_fraction=0.1", f"train.out_dir={tmp_path / 'run'}"])
    result = train(cfg, sample_tokens=0)
    assert math.isfinite(result["loss"]) and math.isfinite(result["eval_loss"])
    logged = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(logged) == 2
    for r in logged:
        assert 0.1 < r["trained_fraction"] < 0.9  # the answers, not the questions / system lines


def test_a_vision_model_refuses_chat_data():
    from k3jax.data.images import make_dataset

    cfg = load_config("tiny_vl", ["train.data.format=chat"])
    with pytest.raises(ValueError, match="train.data.format=chat: chat data trains a text model"):
        make_dataset(cfg, ByteTokenizer())
