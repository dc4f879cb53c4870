"""RL prompt data: records of prompts (and the fields the rewards read), their held-out split, token ids,
and a resumable batch iterator.

A prompt record (a JSONL line, a parquet row or an ArrayRecord record; ``k3jax.data.sources.open_records``)
is a JSON object with exactly one of

- ``prompt``: a plain text prompt (a non-empty string), or
- ``messages``: an OpenAI-style conversation (``k3jax.data.chat``), the whole of which is the prompt,
  rendered with ``chat_prompt`` (ending with the generation prompt); it must not end with an assistant turn
  (the model would answer its own answer; an SFT conversation's last reply belongs in ``answer``),

an optional ``tools`` list (chat records only), and any other fields (``answer``, ...), which go to the
reward functions (:attr:`PromptRecord.fields`, ``k3jax.rl.rewards``). A record that breaks these rules
raises ``k3jax.data.sources.BadRecordError`` naming its file and record.

``source="bundled"``: the bundled chat set (``k3jax/data/corpus/chat.jsonl``) as prompts: each
conversation whose last message is an assistant turn becomes the prompt of the messages before it, with
``answer`` = that turn's content ("How many chapters does Genesis have?" -> "Genesis has 50 chapters.").

Held-out split: the chat fine-tune's own rule, ``k3jax.data.pipeline.split_indices`` over the *record
indices* of the source (a fixed splitmix64 hash of each index, ``eval_fraction`` of them held out, at least
one; independent of any seed), so with the same ``eval_fraction`` (``train.data.eval_fraction``) the RL
held-out prompts are exactly the held-out conversations of a chat fine-tune on the same source.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from k3jax.data.chat import chat_prompt, parse_conversation
from k3jax.data.pipeline import splitmix64, split_indices
from k3jax.data.sources import BadRecordError, bundled_chat_path, open_records

PROMPT_KEYS = ("prompt", "messages", "tools")  # not passed to the rewards as fields


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``messages`` (validated chat messages, ``k3jax.data.chat.Conversation`` style) or ``text``
    (a plain prompt), never both; ``tools`` (chat only, or None); ``fields``: the record's other fields, for
    the rewards; ``where``: its file and record, for errors."""

    messages: tuple[dict, ...] | None
    text: str | None
    tools: tuple[dict, ...] | None
    fields: dict[str, Any]
    where: str

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _content_text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def parse_prompt(record: Any, where: str) -> PromptRecord:
    """A prompt record (module docstring) -> :class:`PromptRecord`; a bad one raises ``BadRecordError``
    naming ``where``. ``None`` values count as absent (parquet rows hold every column)."""
    if not isinstance(record, Mapping):
        raise BadRecordError(f"{where}: expected a JSON object with a 'prompt' or 'messages' field, got "
                             f"{type(record).__name__}")
    present = [k for k in ("prompt", "messages") if record.get(k) is not None]
    fields = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    if len(present) != 1:
        problem = "both 'prompt' and 'messages'" if present else "neither 'prompt' nor 'messages'"
        raise BadRecordError(f"{where}: a prompt record has {problem}; fields: {sorted(record)}")
    if present == ["prompt"]:
        text = record["prompt"]
        if not isinstance(text, str):
            raise BadRecordError(f"{where}: 'prompt' is {type(text).__name__}, not a string")
        if not text.strip():
            raise BadRecordError(f"{where}: 'prompt' is empty")
        if record.get("tools") is not None:
            raise BadRecordError(f"{where}: 'tools' needs a chat prompt ('messages'), not a text 'prompt'")
        return PromptRecord(None, text, None, fields, where)
    try:
        conv = parse_conversation(record, where)
    except ValueError as e:
        raise BadRecordError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    if conv.messages[-1]["role"] == "assistant":
        raise BadRecordError(f"{where}: the prompt's last message is an assistant turn; a prompt ends where the "
                             "model's reply starts (move a reference reply into a field such as 'answer')")
    return PromptRecord(conv.messages, None, conv.tools, fields, where)


def _bundled_prompt(record: Any, where: str) -> PromptRecord | None:
    """A bundled chat conversation -> the prompt of all but its last (assistant) message, ``answer`` = that
    message's content; None when it does not end with an assistant turn with content."""
    try:
        conv = parse_conversation(record, where)
    except ValueError as e:
        raise BadRecordError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    last = conv.messages[-1]
    answer = _content_text(last["content"])
    if last["role"] != "assistant" or len(conv.messages) < 2 or not answer.strip():
        return None
    fields = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    fields["answer"] = answer
    return PromptRecord(conv.messages[:-1], None, conv.tools, fields, where)


class PromptSet:
    """Random access to the prompts of one split: ``len(ps)``, ``ps[i] -> PromptRecord`` (read and validated
    on access), ``ps.where(i)``; ``ps.indices``: the record index in the source of each prompt."""

    def __init__(self, records, indices: np.ndarray, convert=parse_prompt, name: str = ""):
        self.records, self.indices, self._convert, self.name = records, np.asarray(indices, np.int64), convert, name

    def __len__(self) -> int:
        return len(self.indices)

    def where(self, i: int) -> str:
        return self.records.where(int(self.indices[i]))

    def __getitem__(self, i: int) -> PromptRecord:
        index = int(self.indices[i])  # IndexError for i out of range
        where = self.records.where(index)
        record = self._convert(self.records[index], where)
        if record is None:  # only for sets built without filtering (open_prompts filters the bundled set)
            raise BadRecordError(f"{where}: not a prompt")
        return record

    def check(self) -> None:
        """Read and validate every prompt (one held at a time); the first bad one raises ``BadRecordError``."""
        for i in range(len(self)):
            self[i]

    def __repr__(self) -> str:
        return f"PromptSet({self.name!r}, {len(self)} prompts)"


def open_prompts(source: str, *, split: str = "train", eval_fraction: float = 0.1, check: bool = True,
                 pattern: str | None = None) -> PromptSet:
    """The prompts of ``split`` (``"train"`` / ``"eval"``) of ``source``: ``"bundled"`` or a file, directory
    or glob of JSONL / parquet / ArrayRecord prompt records (module docstring).

    The split is ``k3jax.data.pipeline.split_indices(len(records), eval_fraction, split)`` over the record
    indices (the chat fine-tune's rule); for ``"bundled"`` the conversations that make no prompt are
    dropped after splitting. ``check``: validate every prompt of the split now (a bad record raises
    ``BadRecordError`` here rather than mid-run; one record held at a time). ``pattern``: keep only the prompts
    whose last message (or text) a regex search finds it in (``train.rl.prompt_pattern``; after splitting, so
    the held-out prompts stay held out)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    bundled = source == "bundled"
    records = open_records(str(bundled_chat_path()) if bundled else source)
    indices = split_indices(len(records), eval_fraction, split)
    convert = _bundled_prompt if bundled else parse_prompt
    if bundled:  # small: read it all to keep the conversations that make a prompt
        indices = np.asarray([i for i in indices if _bundled_prompt(records[int(i)], records.where(int(i)))],
                             np.int64)
    prompts = PromptSet(records, indices, convert, source)
    if pattern is not None:
        found = re.compile(pattern).search
        prompts.indices = np.asarray([prompts.indices[i] for i in range(len(prompts)) if found(_last_text(prompts[i]))],
                                     np.int64)
    if len(prompts) == 0:
        raise ValueError(f"the {split} split of the prompts {source!r} is empty ({len(records)} records, "
                         f"eval_fraction={eval_fraction})")
    if check and not bundled:
        prompts.check()
    return prompts


def _last_text(record: PromptRecord) -> str:
    """What ``open_prompts``' pattern is matched against: the text prompt, or the last message's text."""
    if record.text is not None:
        return record.text
    content = record.messages[-1].get("content") or ""
    return content if isinstance(content, str) else " ".join(part.get("text", "") for part in content)


def prompt_ids(tokenizer, record: PromptRecord) -> list[int]:
    """Token ids of the prompt: a chat prompt through ``k3jax.data.chat.chat_prompt`` (the checkpoint's chat
    format, or the plain transcript, ending with the generation prompt); a text prompt ``encode``-d, after
    the tokenizer's BOS when it has one (as training documents start). A prompt the chat format cannot
    render raises ``BadRecordError`` naming the record."""
    if not record.is_chat:
        bos = getattr(tokenizer, "bos_id", None)
        return ([bos] if bos is not None else []) + list(tokenizer.encode(record.text))
    try:
        return chat_prompt(tokenizer, record.messages, list(record.tools) if record.tools else None)
    except Exception as e:  # the transcript's own refusal or a template's error
        raise BadRecordError(f"{record.where}: the chat format cannot render it: {type(e).__name__}: {e}") from e


def prompt_text(tokenizer, record: PromptRecord) -> str:
    """The prompt as a string for the reward functions' ``prompts`` argument: a text prompt as is, a chat
    prompt as its rendered ids decoded."""
    return record.text if not record.is_chat else tokenizer.decode(prompt_ids(tokenizer, record))


_MASK = (1 << 64) - 1


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the ``n`` prompts in ``epoch`` (int64[n]): a sort by a splitmix64 hash of each index
    salted with (seed, epoch). Pure integer arithmetic, so it is the same on every machine and numpy
    version (a resumed run gets the same order)."""
    salt = splitmix64(np.asarray([(seed & _MASK)], np.uint64))[0]
    salt = splitmix64(np.asarray([salt ^ np.uint64(epoch & _MASK)], np.uint64))[0]
    keys = splitmix64(np.arange(n, dtype=np.uint64) ^ salt)  # distinct: splitmix64 is a bijection
    return np.argsort(keys, kind="stable").astype(np.int64)


class PromptIterator:
    """An endless iterator of batches (``list[PromptRecord]`` of ``batch_size``) over ``prompts`` (any
    random-access sequence, e.g. a :class:`PromptSet`), in a new seeded order every epoch
    (:func:`epoch_permutation`). The epochs form one stream: a batch may end one epoch and start the next,
    and each prompt comes once per epoch.

    ``get_state()`` -> a JSON-serialisable dict of the position; ``set_state(state)`` on an iterator over the
    same prompts and seed continues with exactly the batches the saved one would have produced next (a
    different ``batch_size`` is allowed: the state is a position in the stream of prompts)."""

    def __init__(self, prompts: Sequence, batch_size: int, seed: int = 0):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(prompts) == 0:
            raise ValueError("PromptIterator: no prompts")
        self.prompts, self.batch_size, self.seed = prompts, int(batch_size), int(seed)
        self.epoch, self.position = 0, 0
        self._order = epoch_permutation(len(prompts), self.seed, 0)

    def __iter__(self) -> Iterator[list]:
        return self

    def next_indices(self) -> list[int]:
        """The indices into ``prompts`` of the next batch (advances the position)."""
        out = []
        while len(out) < self.batch_size:
            take = min(self.batch_size - len(out), len(self._order) - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = epoch_permutation(len(self.prompts), self.seed, self.epoch)
        return out

    def __next__(self) -> list:
        return [self.prompts[i] for i in self.next_indices()]

    def get_state(self) -> dict:
        """``{"seed", "num_prompts", "epoch", "position"}``: where the next batch starts."""
        return {"seed": self.seed, "num_prompts": len(self.prompts), "epoch": self.epoch, "position": self.position}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (:meth:`get_state`); a state of other prompts or another seed raises
        ``ValueError`` (the order would not be the saved run's)."""
        if int(state["seed"]) != self.seed or int(state["num_prompts"]) != len(self.prompts):
            raise ValueError(f"PromptIterator.set_state: the state is of {state['num_prompts']} prompts with seed "
                             f"{state['seed']}; this iterator has {len(self.prompts)} prompts with seed {self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.prompts):
            raise ValueError(f"PromptIterator.set_state: bad position (epoch {epoch}, position {position})")
        self.epoch, self.position = epoch, position
        self._order = epoch_permutation(len(self.prompts), self.seed, epoch)


__all__ = ["PROMPT_KEYS", "PromptIterator", "PromptRecord", "PromptSet", "epoch_permutation", "open_prompts",
           "parse_prompt", "prompt_ids", "prompt_text"]
