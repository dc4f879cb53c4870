"""Tokenizers for training data: bytes (the demo), a local HF ``tokenizer.json``, a tiktoken model.

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
  tokenizer of :mod:`k3jax.tokenizer` (tiktoken BPE + the release's special tokens).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Protocol, Sequence, runtime_checkable

from k3jax import storage


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


def _token_content(tok) -> str | None:
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    return None


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
        self.bos_token = bos_token or _token_content(cfg.get("bos_token")) or self._first_present(_COMMON_BOS)
        self.eos_token = eos_token or _token_content(cfg.get("eos_token")) or self._first_present(_COMMON_EOS)

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


def _load_tiktoken(path: pathlib.Path):
    """The Kimi tiktoken tokenizer of ``k3jax.tokenizer`` (directory of a release, or its
    ``tiktoken.model`` file; a ``tokenizer_config.json`` beside it supplies the special tokens)."""
    from k3jax import tokenizer as kimi_tokenizer

    directory = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != "tiktoken.model":
        # A tiktoken ranks file under another name: load it directly.
        cfg_file = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return kimi_tokenizer.Tokenizer(kimi_tokenizer.load_ranks(path), cfg)
    return kimi_tokenizer.Tokenizer.from_dir(directory)


def load_tokenizer(spec: str, *, source: str = "train.data.tokenizer") -> TextTokenizer:
    """``"byte"``, a ``tokenizer.json`` (file or directory) or a ``tiktoken.model`` (file or
    directory; also ``*.tiktoken``). Raises ``FileNotFoundError`` / ``ValueError`` with the reason,
    naming ``source``: where the spec came from (the config field, or e.g. ``--tokenizer``).
    The one loader of the project: training and ``infer.py`` (hence serving) take their tokenizer here
    (a release directory gives :class:`k3jax.tokenizer.Tokenizer`, with its chat template)."""
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


__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "load_tokenizer"]
