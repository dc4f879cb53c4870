"""The tiktoken-based Kimi tokenizer on a small BPE file built here (release file format)."""

import base64
import json

import pytest

pytest.importorskip("tiktoken")

from k3jax.tokenizer import END_OF_MSG, OPEN, SEP, Tokenizer, render_xtml  # noqa: E402

MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b"ld", b" wor", b" world", b"\xe4\xbd", b"\xe4\xbd\xa0"]


def write_tokenizer(path, *, k3: bool, chat_template: str | None = None):
    ranks = {bytes([i]): i for i in range(256)}
    for m in MERGES:
        ranks[m] = len(ranks)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    names = (["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"] if k3 else
             ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"])
    tc = {"added_tokens_decoder": {str(n + i): {"content": s, "special": True} for i, s in enumerate(names)},
          "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "pad_token": "[PAD]",
          "tokenizer_class": "TikTokenTokenizer"}
    tc["added_tokens_decoder"][str(n + 255)] = {"content": "[PAD]", "special": True}
    if chat_template:
        tc["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    (path / "config.json").write_text(json.dumps({"eos_token_id": n + 2}))
    return n


@pytest.fixture
def k3_tok(tmp_path):
    n = write_tokenizer(tmp_path, k3=True)
    return Tokenizer.from_dir(tmp_path), n


def test_encode_decode_and_specials(k3_tok):
    tok, n = k3_tok
    assert tok.vocab_size == n + 256
    assert tok.special_tokens["<|open|>"] == n + 3 and tok.special_tokens[f"<|reserved_token_{n + 7}|>"] == n + 7
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 255)
    assert n + 2 in tok.stop_ids and n + 1 in tok.stop_ids  # <|end_of_msg|> (config eos) and [EOS]
    ids = tok.encode("hello world")
    assert ids == [n - len(MERGES) + MERGES.index(b"hello"), n - len(MERGES) + MERGES.index(b" world")]
    for text in ("hello world", "你好 hello\n\n  world!!", "x" * 30000 + " " * 26000 + "y", "123456 abc's"):
        assert tok.decode(tok.encode(text)) == text
    # special spellings are plain text unless allowed
    assert n + 3 not in tok.encode("<|open|>") and tok.encode("<|open|>", allow_special=True) == [n + 3]
    assert tok.encode("hi", add_bos=True)[0] == n
    assert tok.decode([n + 3, *tok.encode("hello")], skip_special=True) == "hello"


def test_k3_xtml_chat(k3_tok):
    tok, n = k3_tok
    msgs = [{"role": "user", "content": "hello <|open|>"},
            {"role": "assistant", "content": "world", "reasoning_content": "hm"},
            {"role": "user", "content": "again"}]
    text = tok.apply_chat_template(msgs, tokenize=False, thinking_effort=None)
    assert text == ('<|open|>message role="user"<|sep|>hello <|open|><|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>hm<|close|>think<|sep|>'
                    '<|open|>response<|sep|>world<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="user"<|sep|>again<|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    ids = tok.apply_chat_template(msgs, thinking_effort=None)
    # user text spelling a marker stays text: exactly one <|open|> id per rendered tag
    assert ids.count(n + 3) == text.count("<|open|>") - 1
    assert tok.decode(ids) == text
    # the release's default: a thinking-effort system message first
    default = tok.apply_chat_template(msgs[:1], tokenize=False)
    assert default.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert "thinking_effort=max" in default


def test_xtml_tools():
    segs = render_xtml([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"a": 1, "b": "x"}'}}]},
        {"role": "tool", "content": "42"}], tools=[{"name": "f", "parameters": {"b": 1, "a": 2}}],
        add_generation_prompt=False)
    text = "".join(s.text for s in segs)
    assert '{"name":"f","parameters":{"a":2,"b":1}}' in text  # sorted, compact schema
    assert f'{OPEN}call tool="f" index="1"{SEP}{OPEN}argument key="a" type="number"{SEP}1' in text
    assert f'{OPEN}message role="tool" tool="f" index="1"{SEP}42' in text
    assert text.endswith(END_OF_MSG)


def test_jinja_template(tmp_path):
    template = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    n = write_tokenizer(tmp_path, k3=False, chat_template=template)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[0] == n + 3 and ids[-1] == n + 4 and n + 2 in ids
    assert tok.decode(ids) == "<|im_user|>hello<|im_end|><|im_assistant|>"
