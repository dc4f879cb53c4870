"""Tokenizers, and the one loader training and inference take theirs from (:func:`load_tokenizer`).

All of them follow one small protocol (:class:`TextTokenizer`): ``encode(str) -> list[int]``,
``decode(list[int]) -> str``, ``vocab_size``, and ``bos_id`` / ``eos_id`` (``None`` when the
tokenizer has no such token). The data pipeline prepends ``bos_id`` and appends ``eos_id`` to every
document when they exist.

``load_tokenizer(spec, source=...)``:
- ``"byte"``: :class:`ByteTokenizer`, UTF-8 bytes as ids 0..255, nothing reserved (no BOS/EOS:
  the model never sees an end-of-document token; the ``tiny`` config's vocab is exactly 256).
- a path to a ``tokenizer.json`` (or a directory holding one): :class:`HFTokenizer`, via the
  ``tokenizers`` package (it comes with ``transformers``). BOS/EOS come from a sibling
  ``tokenizer_config.json`` (``bos_token`` / ``eos_token``) when there is one, else from a few
  common special-token spellings found in the vocabulary.
- a path to a ``tiktoken.model`` (or a directory holding one, e.g. a Kimi release): the Kimi
  tokenizer, :class:`Tokenizer` (below).

The Kimi tokenizer (K2, Kimi Linear, K3) from a local Hugging Face download, via ``tiktoken``.

A release directory holds ``tiktoken.model`` (base64 ``<token bytes> <rank>`` lines: the BPE
ranks) and ``tokenizer_config.json`` (special tokens in ``added_tokens_decoder``, ``bos_token`` /
``eos_token`` / ..., and for K2 / Kimi Linear a jinja ``chat_template``). Ids ``[n_base, n_base +
256)`` are special tokens: the named ones from ``added_tokens_decoder``, the rest
``<|reserved_token_{id}|>`` (the release's tokenization_kimi.py).

Chat rendering: a jinja ``chat_template`` (``tokenizer_config.json`` or ``chat_template.jinja``)
is rendered like transformers does; without one, and when the vocabulary has K3's
``<|open|> <|sep|> <|close|> <|end_of_msg|>`` markers, the K3 "XTML" format is rendered
programmatically (the release ships ``encoding_k3.py`` instead of a template), segment by segment
so that message text can never produce a control token.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import pathlib
from typing import Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from k3jax.runtime import storage

# ``tokenization_kimi.py:TikTokenTokenizer.pat_str`` (verbatim; needs the Rust regex of tiktoken).
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256
# The release chops text before BPE (tokenization_kimi.py): 400k characters per tiktoken call and at
# most 25k consecutive whitespace / non-whitespace characters (tiktoken issue #195). The cuts change
# merges, so they are part of the format.
MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE_CHARS = 25_000

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINKING_EFFORTS = ("low", "high", "max")


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """``tiktoken.model`` -> {token bytes: rank} (same as ``tiktoken.load.load_tiktoken_bpe``)."""
    ranks = {}
    for line in pathlib.Path(path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _content(tok: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it (a string, or an ``AddedToken`` entry
    ``{"content": ...}``) -> its text; None for anything else."""
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    return None


# ---------------------------------------------------------------------------------------------
# The protocol, the byte and tokenizer.json tokenizers, and the loader


@runtime_checkable
class TextTokenizer(Protocol):
    vocab_size: int

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocab 256, no special tokens, lossless on any text.

    ``decode`` replaces invalid UTF-8 (e.g. a sequence cut inside a multi-byte character) with
    U+FFFD instead of failing, so sampling from a model always decodes.
    """

    vocab_size = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


_COMMON_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_COMMON_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (no transformers import).

    ``encode`` adds no special tokens itself (the pipeline adds BOS/EOS); ``decode`` keeps them.
    """

    def __init__(self, path: str | os.PathLike, *, bos_token: str | None = None, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers ships with transformers
            raise ImportError("loading a tokenizer.json needs the `tokenizers` package "
                              "(pip install tokenizers, or transformers)") from e
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        self.path = path
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg_file = path.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.bos_token = bos_token or _content(cfg.get("bos_token")) or self._first_present(_COMMON_BOS)
        self.eos_token = eos_token or _content(cfg.get("eos_token")) or self._first_present(_COMMON_EOS)

    def _first_present(self, names: Sequence[str]) -> str | None:
        for n in names:
            if self._tok.token_to_id(n) is not None:
                return n
        return None

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _load_tiktoken(path: pathlib.Path) -> "Tokenizer":
    """The Kimi tiktoken tokenizer (directory of a release, or its ``tiktoken.model`` file; a
    ``tokenizer_config.json`` beside it supplies the special tokens)."""
    directory = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != "tiktoken.model":
        # A tiktoken ranks file under another name: load it directly.
        cfg_file = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return Tokenizer(load_ranks(path), cfg)
    return Tokenizer.from_dir(directory)


def load_tokenizer(spec: str, *, source: str = "train.data.tokenizer") -> TextTokenizer:
    """``"byte"``, a ``tokenizer.json`` (file or directory) or a ``tiktoken.model`` (file or
    directory; also ``*.tiktoken``). Raises ``FileNotFoundError`` / ``ValueError`` with the reason,
    naming ``source``: where the spec came from (the config field, or e.g. ``--tokenizer``).
    The one loader of the project: training and ``infer.py`` (hence serving) take their tokenizer here
    (a release directory gives :class:`Tokenizer`, with its chat template)."""
    if spec in ("byte", "bytes"):
        return ByteTokenizer()
    if storage.is_remote(spec):  # a URL (gs://...): read from a copy in the local storage cache
        if not storage.exists(spec):
            raise FileNotFoundError(f"{source}: {spec!r} is neither 'byte' nor an existing path")
        spec = str(storage.local_copy(spec))
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{source}: {spec!r} is neither 'byte' nor an existing path")
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return HFTokenizer(path)
        if (path / "tiktoken.model").exists():
            return _load_tiktoken(path)
        raise FileNotFoundError(f"{source}: directory {path} has neither tokenizer.json nor tiktoken.model")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.name == "tiktoken.model" or path.suffix in (".tiktoken", ".model"):
        return _load_tiktoken(path)
    raise ValueError(f"{source}: cannot tell the format of {path} "
                     "(expected tokenizer.json, tiktoken.model or *.tiktoken)")


# ---------------------------------------------------------------------------------------------
# The Kimi tokenizer


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Pieces with at most ``max_run`` consecutive whitespace / non-whitespace characters each."""
    if len(text) <= max_run:
        yield text
        return
    run, is_space, start = 0, text[0].isspace(), 0
    for i, ch in enumerate(text):
        sp = ch.isspace()
        if sp != is_space:
            run, is_space = 1, sp
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


@dataclasses.dataclass(frozen=True)
class Segment:
    """A rendered piece of a chat prompt; ``special`` pieces are control markers."""

    text: str
    special: bool = False


class Tokenizer:
    """tiktoken BPE + Kimi special tokens + chat template."""

    def __init__(self, ranks: dict[bytes, int], tokenizer_config: Mapping | None = None, *,
                 chat_template: str | None = None, eos_token_ids: Sequence[int] = (),
                 num_reserved_special: int = NUM_RESERVED_SPECIAL, name: str = "kimi"):
        import tiktoken

        tc = dict(tokenizer_config or {})
        self.num_base = len(ranks)
        named = {int(i): _content(v) for i, v in (tc.get("added_tokens_decoder") or {}).items()}
        n_special = max([num_reserved_special] + [i - self.num_base + 1 for i in named])
        self.special_tokens: dict[str, int] = {}
        for i in range(self.num_base, self.num_base + n_special):
            self.special_tokens[named.get(i) or f"<|reserved_token_{i}|>"] = i
        self.encoding = tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.vocab_size = self.num_base + n_special
        self.id_to_special = {i: s for s, i in self.special_tokens.items()}
        self.bos_token = _content(tc.get("bos_token"))
        self.eos_token = _content(tc.get("eos_token"))
        self.pad_token = _content(tc.get("pad_token"))
        self.unk_token = _content(tc.get("unk_token"))
        self.chat_template = chat_template if chat_template is not None else tc.get("chat_template")
        stops = [self.eos_id] if self.eos_id is not None else []
        for tok in (END_OF_MSG, "<|im_end|>"):
            if tok in self.special_tokens:
                stops.append(self.special_tokens[tok])
        self.stop_ids = tuple(dict.fromkeys([*stops, *eos_token_ids]))

    # --- loading --------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tiktoken.model`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``,
        and ``eos_token_id`` from ``generation_config.json`` / ``config.json``) from a directory."""
        path = pathlib.Path(path)
        model = path / "tiktoken.model"
        if not model.exists():
            raise FileNotFoundError(f"{path}: no tiktoken.model")
        tc_path = path / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        template = None
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            f = path / fname
            if f.exists():
                cfg = json.loads(f.read_text())
                for c in (cfg, cfg.get("text_config") or {}):
                    e = c.get("eos_token_id")
                    eos.extend(e if isinstance(e, list) else [] if e is None else [e])
        return cls(load_ranks(model), tc, chat_template=template, eos_token_ids=eos)

    # --- ids ------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        ids = self.encoding.encode(token, disallowed_special=())
        return ids[0] if len(ids) == 1 else None

    @property
    def bos_id(self) -> int | None:
        return self.special_tokens.get(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.special_tokens.get(self.eos_token) if self.eos_token else None

    @property
    def pad_id(self) -> int | None:
        return self.special_tokens.get(self.pad_token) if self.pad_token else None

    # --- encode / decode ------------------------------------------------------------------
    def encode(self, text: str, *, allow_special: bool = False, add_bos: bool = False) -> list[int]:
        """Text -> ids. ``allow_special``: spellings of special tokens become their ids (else they
        are encoded as plain text). No BOS unless ``add_bos`` (the release prepends none)."""
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start:start + MAX_ENCODE_CHARS], MAX_CONSECUTIVE_CHARS):
                if allow_special:
                    ids.extend(self.encoding.encode(piece, allowed_special="all"))
                else:
                    ids.extend(self.encoding.encode(piece, disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i < self.num_base]
        return self.encoding.decode(ids)

    # --- chat -----------------------------------------------------------------------------
    @property
    def has_xtml(self) -> bool:
        return all(t in self.special_tokens for t in (OPEN, CLOSE, SEP, END_OF_MSG))

    def render_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping] | None = None, **kwargs) -> list[Segment]:
        """The prompt as segments. Uses the jinja template when there is one, else K3's XTML."""
        if self.chat_template:
            text = self._render_jinja(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
            return [Segment(text, special=True)]  # a template's output is encoded with specials recognised
        if self.has_xtml:
            return render_xtml(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        raise ValueError("this tokenizer has no chat template and no K3 XTML markers")

    def apply_chat_template(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: Sequence[Mapping] | None = None, **kwargs):
        """Ids (or, with ``tokenize=False``, the string) of a chat prompt. For K3 the defaults of
        the release's entry point apply (``thinking_effort='max'``)."""
        if not self.chat_template and self.has_xtml:
            kwargs.setdefault("thinking_effort", "max")
        segments = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if not tokenize:
            return "".join(s.text for s in segments)
        ids: list[int] = []
        for s in segments:
            ids.extend(self.encode(s.text, allow_special=s.special))
        return ids

    def _render_jinja(self, messages, *, add_generation_prompt, tools, **kwargs) -> str:
        return _compiled_template(self.chat_template).render(
            messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _raise_template_error(msg):
    import jinja2

    raise jinja2.exceptions.TemplateError(msg)


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """The jinja template compiled once per template text, in the sandbox transformers renders in
    (compiling costs ~10 ms, rendering a conversation well under one: chat data renders every record)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(template)


# ---------------------------------------------------------------------------------------------
# K3 XTML (the release's encoding_k3.build_chat_segments)


def _escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _compact_json(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=(",", ":"))


def _deep_sort(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _deep_sort(x[k]) for k in sorted(x)}
    if isinstance(x, (list, tuple)):
        return [_deep_sort(v) for v in x]
    return x


def _xtml_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, Mapping) else "array"


class _Xtml:
    def __init__(self):
        self.segments: list[Segment] = []

    def control(self, text):
        self.segments.append(Segment(text, True))

    def text(self, text):
        text = str(text)
        if text:
            self.segments.append(Segment(text, False))

    def open(self, tag, attrs=()):
        self.control(OPEN)
        self.text(tag)
        for k, v in attrs:
            self.text(f" {k}")
            self.text('="')
            self.text(_escape_attr(v))
            self.text('"')
        self.control(SEP)

    def close(self, tag):
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def content(self, content):
        if isinstance(content, str):
            self.text(content)
        elif content is not None:
            for part in content:
                if part.get("type") != "text":
                    raise NotImplementedError(f"content part of type {part.get('type')!r} (text only)")
                self.text(part["text"])

    def message(self, attrs, content):
        self.open("message", attrs)
        self.content(content)
        self.close("message")
        self.control(END_OF_MSG)

    def system(self, kind, body):
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.close("message")
        self.control(END_OF_MSG)


def render_xtml(messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = True, thinking: bool = True, thinking_effort: str | None = None,
                tool_choice: str | None = None) -> list[Segment]:
    """K3's chat format: ``<|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>``;
    assistant turns nest ``think`` / ``response`` channels and an optional ``tools`` block; the
    generation prompt is ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``."""
    r = _Xtml()
    if tools:
        r.system("tool-declare", "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
                 f"```json\n{_compact_json(_deep_sort(list(tools)))}\n```")
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort must be one of {THINKING_EFFORTS}, got {thinking_effort!r}")
        r.system("thinking-effort",
                 "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                 "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                 f"Now the system is invoked with `thinking_effort={thinking_effort}`.")
    calls, tool_index = None, 0
    for m in messages:
        role = m["role"]
        if role in ("user", "system"):
            attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
            r.message(attrs, m.get("content"))
        elif role == "tool":
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls and tool_index <= len(calls):
                name = (calls[tool_index - 1].get("function") or calls[tool_index - 1])["name"]
            if name is None:
                raise ValueError("a tool message needs a tool name (tool / name, or a matching tool call)")
            r.message([("role", "tool"), ("tool", name), ("index", tool_index)], m.get("content"))
        elif role == "assistant":
            calls, tool_index = m.get("tool_calls"), 0
            r.open("message", [("role", "assistant")] + ([("name", m["name"])] if m.get("name") else []))
            if thinking:
                r.open("think")
                reasoning = m.get("reasoning_content") or m.get("reasoning")
                if reasoning is not None and str(reasoning).strip():
                    r.text(reasoning)
                r.close("think")
            r.open("response")
            r.content(m.get("content"))
            r.close("response")
            if calls:
                r.open("tools")
                for k, call in enumerate(calls, 1):
                    fn = call.get("function") or call
                    r.open("call", [("tool", fn["name"]), ("index", k)])
                    args = fn.get("arguments") or {}
                    if isinstance(args, str):
                        args = json.loads(args) if args.strip() else {}
                    for key, value in args.items():
                        r.open("argument", [("key", key), ("type", _xtml_type(value))])
                        r.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                        r.close("argument")
                    r.close("call")
                r.close("tools")
            r.close("message")
            r.control(END_OF_MSG)
        else:
            raise ValueError(f"unknown role {role!r}")
    if tool_choice in ("required", "none"):
        body = ("The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
                if tool_choice == "required" else
                "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.")
        r.system("tool-choice", body)
    if add_generation_prompt:
        r.open("message", [("role", "assistant")])
        r.open("think" if thinking else "response")
    return r.segments


__all__ = ["PAT_STR", "ByteTokenizer", "HFTokenizer", "Segment", "TextTokenizer", "Tokenizer", "load_ranks",
           "load_tokenizer", "render_xtml"]
