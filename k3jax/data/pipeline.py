"""The training input pipeline (grain): documents -> tokens -> first-fit packed rows -> batches.

``make_train_dataset(train_cfg, tokenizer)`` returns a ``grain.IterDataset``; ``iter(ds)`` yields
numpy dicts for this process's share of one global batch (``B = batch_size / process_count``
rows, ``T = seq_len``):

====================  ===============  =============================================================
key                   dtype [B, T]     meaning
====================  ===============  =============================================================
``tokens``            int32            input ids (0 in padding)
``segment_ids``       int32            1, 2, ... per packed piece within a row; 0 = padding
``positions``         int32            position within the piece (restarts at 0 at each piece)
``targets``           int32            the next token of the same document; -1 in padding
``loss_mask``         float32          1.0 where ``targets`` is trained, 0.0 elsewhere and in padding
====================  ===============  =============================================================

Target convention (targets never cross documents). Each document becomes
``ids = [bos] + encode(text) + [eos]`` (BOS / EOS only when the tokenizer has them) and is turned
into shifted pairs ``inputs = ids[:-1]``, ``targets = ids[1:]`` *before* packing, so the last real
token of a document predicts EOS when there is one, and with no EOS (the byte tokenizer) it is
simply not an input. Documents longer than ``seq_len`` pairs are cut into pieces of ``seq_len``
pairs (the last one shorter); each piece is packed as its own segment (positions restart, the model
resets its KDA state, conv window and attention at the piece start). A piece's last target is the
next token of the same document (the first input of the next piece), never a token of another
document. Every non-padding position therefore has a valid target, and for text every one is trained.

Chat data (``train.data.format: chat``, ``k3jax.data.chat``): each conversation is one example of
(inputs, targets, per-target mask), truncated or dropped when longer than ``seq_len``, never cut
into pieces; the mask covers the assistant turns (``train.data.chat_loss``). Pieces of both kinds
carry their mask (``loss_mask``, all ones for text) into packing, which packs it beside inputs and
targets, so each packed segment keeps its own mask: ``loss_mask`` is that packed mask (0 in padding).
When the train dataset is built, every chat record is read and rendered once (validation, and the
counts of truncated / dropped / skipped conversations, printed by process 0); the pipeline then
renders each conversation again as it reads it, holding none in memory.

Order of operations: document indices of the split (train / eval: a deterministic hash of each
document's *index*, ``eval_fraction`` of them held out; at least one when the fraction is > 0 and
there are >= 2 documents) -> this process's share ``[process_index::process_count]`` (disjoint,
covering) -> document shuffle (seeded, reshuffled every epoch) -> epochs (``num_epochs``, ``None``
= forever) -> tokenize and cut into pieces -> window shuffle of pieces (train, so a batch mixes many
documents rather than consecutive pieces of one) -> first-fit packing into ``B`` bins of ``T``
(``grain.experimental.FirstFitPackIterDataset``, bins shuffled with the seed) -> batches of ``B``
rows. The eval split is neither shuffled nor repeated; its last batch is padded with empty rows.

Bad records (``train.data.bad_records``, ``k3jax.data.sources.GuardedRecords``): reading a document or
conversation, and making its pieces, happen under the policy: ``stop`` raises
``k3jax.data.sources.BadRecordError`` naming the file and record; ``skip`` drops the record and counts it
in the train dataset's ``bad_records`` (a ``SkippedRecords``), which the trainer logs.

The iterator is checkpointable: ``it.get_state()`` / ``it.set_state(state)`` (or
``grain.checkpoint.CheckpointSave(it)`` with orbax) resumes at exactly the next batch.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import grain
import numpy as np

from k3jax.config import TrainConfig
from k3jax.data.chat import ConversationToPieces, open_conversations, scan_conversations
from k3jax.data.sources import GuardedRecords, SkippedRecords, open_documents
from k3jax.tokenizer import TextTokenizer, load_tokenizer

# Window shuffle of pieces: at most this many pieces and about this many tokens held in memory.
_WINDOW_PIECES = 1024
_WINDOW_TOKENS = 1 << 22
# Documents are read in the consumer's thread, like tokenizing and packing: reader threads only pay
# off for slow storage, and on a busy CPU their hand-offs cost more than the reads (measured: 30 ms
# per document at load 10 on 2 cores). For throughput wrap the dataset, e.g. ``ds.mp_prefetch()``.
_READ_THREADS = 0
_READ_PREFETCH = 0


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def document_hash(indices: np.ndarray) -> np.ndarray:
    """A fixed uniform value in [0, 1) for each document index (splitmix64; not seed-dependent, so
    the eval split stays the same across runs and seeds)."""
    return (splitmix64(np.asarray(indices)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def split_indices(num_documents: int, eval_fraction: float, split: Literal["train", "eval"]) -> np.ndarray:
    """Document indices of the train or eval split (sorted)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    u = document_hash(np.arange(num_documents))
    is_eval = u < eval_fraction
    if eval_fraction > 0 and num_documents >= 2 and not is_eval.any():
        is_eval[np.argmin(u)] = True
    return np.nonzero(is_eval if split == "eval" else ~is_eval)[0]


class IndexedDocuments:
    """``source[indices[i]]``: a split of a random-access source."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> str:
        return self.source[int(self.indices[i])]


class DocumentToPieces(grain.experimental.FlatMapTransform):
    """text -> ``[{"inputs": int32[n], "targets": int32[n], "loss_mask": float32[n] (ones)}, ...]``,
    ``n <= seq_len``."""

    max_fan_out = 1 << 20  # only used by the MapDataset flavour of flat_map

    def __init__(self, tokenizer: TextTokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id

    def flat_map(self, text: str) -> list[dict[str, np.ndarray]]:
        ids = self.tokenizer.encode(text)
        if self.bos is not None:
            ids = [self.bos] + ids
        if self.eos is not None:
            ids = ids + [self.eos]
        if len(ids) < 2:
            return []
        arr = np.asarray(ids, np.int32)
        inputs, targets = arr[:-1], arr[1:]
        t = self.seq_len
        return [{"inputs": inputs[i:i + t], "targets": targets[i:i + t],
                 "loss_mask": np.ones(min(t, len(inputs) - i), np.float32)} for i in range(0, len(inputs), t)]


class GuardedPieces(grain.experimental.FlatMapTransform):
    """A pieces transform under the bad-record policy: a record read as None (skipped) has no pieces, and
    one whose pieces cannot be made (a conversation the chat format cannot render) is rejected by
    ``guard`` (raises under ``stop``, counted under ``skip``)."""

    def __init__(self, to_pieces, guard: GuardedRecords):
        self.to_pieces, self.guard = to_pieces, guard
        self.max_fan_out = to_pieces.max_fan_out

    def flat_map(self, item):
        if item is None:
            return []
        index, document = item
        try:
            return self.to_pieces.flat_map(document)
        except ValueError as e:
            self.guard.reject(index, e)
            return []


class _Indexed:
    """``(index, source[index])`` (None when the guarded source skipped it): the pieces stage names the
    record it rejects."""

    def __init__(self, source: GuardedRecords):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        value = self.source[index]
        return None if value is None else (index, value)


def _finalize(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = row["inputs_segment_ids"].astype(np.int32)
    real = seg > 0
    return {
        "tokens": np.where(real, row["inputs"], 0).astype(np.int32),
        "segment_ids": seg,
        "positions": np.where(real, row["inputs_positions"], 0).astype(np.int32),
        "targets": np.where(real, row["targets"], -1).astype(np.int32),
        "loss_mask": np.where(real, row["loss_mask"], 0).astype(np.float32),
    }


def _empty_row(seq_len: int) -> dict[str, np.ndarray]:
    z = np.zeros((seq_len,), np.int32)
    return {"tokens": z, "segment_ids": z, "positions": z, "targets": np.full((seq_len,), -1, np.int32),
            "loss_mask": np.zeros((seq_len,), np.float32)}


def _stack_padded(rows: Sequence[dict[str, np.ndarray]], batch: int, seq_len: int) -> dict[str, np.ndarray]:
    rows = list(rows) + [_empty_row(seq_len)] * (batch - len(rows))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def local_batch_size(train_cfg: TrainConfig, process_count: int) -> int:
    if train_cfg.batch_size % process_count:
        raise ValueError(f"train.batch_size={train_cfg.batch_size} must be divisible by the number of "
                         f"processes ({process_count})")
    return train_cfg.batch_size // process_count


def make_train_dataset(train_cfg: TrainConfig, tokenizer: TextTokenizer | None = None, *,
                       split: Literal["train", "eval"] = "train", process_index: int = 0,
                       process_count: int = 1, documents=None) -> grain.IterDataset:
    """The packed, batched dataset of this process (see the module docstring).

    tokenizer: defaults to ``load_tokenizer(train_cfg.data.tokenizer)``. documents: a random-access
    source of strings (of ``k3jax.data.chat.Conversation``\ s for the chat format) overriding
    ``train_cfg.data.source``.
    """
    data = train_cfg.data
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    tokenizer = load_tokenizer(data.tokenizer) if tokenizer is None else tokenizer
    chat = data.format == "chat"
    if documents is None:
        documents = open_conversations(data.source) if chat else open_documents(data.source, data.format,
                                                                                  data.text_field, data.bad_records)
    batch, seq_len, seed = local_batch_size(train_cfg, process_count), train_cfg.seq_len, train_cfg.seed
    to_pieces = (ConversationToPieces(tokenizer, seq_len, data.chat_loss, data.chat_overflow) if chat
                 else DocumentToPieces(tokenizer, seq_len))
    if chat and split == "train":  # the scan's own guard: its skips are not the run's
        counts = report_chat_counts(GuardedRecords(documents, data.bad_records), to_pieces, data.eval_fraction,
                                    data.source, echo=process_index == 0)
        if counts["train"].trained == 0:  # the repeated split would be read forever for a first batch
            raise ValueError(f"train.data.source={data.source!r}: no conversation of the train split has a trained "
                             f"token ({counts['train'].summary()})")
    indices = split_indices(len(documents), data.eval_fraction, split)
    if len(indices) == 0:
        raise ValueError(f"the {split} split of train.data.source={data.source!r} is empty "
                         f"({len(documents)} documents, eval_fraction={data.eval_fraction})")
    train = split == "train"
    skipped = SkippedRecords()
    guard = GuardedRecords(documents, data.bad_records, skipped)
    ds = grain.MapDataset.source(IndexedDocuments(_Indexed(guard), indices))
    ds = ds[process_index::process_count]
    guard.reachable = len(ds)  # this process's records: all of them bad means nothing to train on
    if len(ds) == 0:
        raise ValueError(f"process {process_index} of {process_count} gets no {split} documents "
                         f"(only {len(indices)} in the split)")
    shuffle = data.shuffle and train
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if train:
        ds = ds.repeat(data.num_epochs)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS, prefetch_buffer_size=_READ_PREFETCH))
    it = grain.experimental.FlatMapIterDataset(it, GuardedPieces(to_pieces, guard))
    if shuffle:
        window = max(batch, min(_WINDOW_PIECES, _WINDOW_TOKENS // seq_len))
        it = grain.experimental.WindowShuffleIterDataset(it, window_size=window, seed=seed + 1)
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct={"inputs": seq_len, "targets": seq_len, "loss_mask": seq_len}, num_packing_bins=batch,
        seed=seed, shuffle_bins=shuffle)
    it = it.map(_finalize)
    if train:
        it = it.batch(batch, drop_remainder=True)
    else:
        it = it.batch(batch, drop_remainder=False, batch_fn=lambda rows: _stack_padded(rows, batch, seq_len))
    it.bad_records = skipped  # what train.data.bad_records=skip dropped (read by the trainer's metrics)
    return it


def report_chat_counts(conversations, to_pieces: ConversationToPieces, eval_fraction: float, source: str, *,
                       echo: bool = True) -> dict[str, Any]:
    """Scan every conversation of the source (``k3jax.data.chat.scan_conversations``: validates every
    record) and print one line per split when ``echo``. Returns ``{split: ChatCounts}``."""
    counts = {}
    for split in ("train", "eval") if eval_fraction > 0 else ("train",):
        counts[split] = scan_conversations(conversations, to_pieces,
                                           split_indices(len(conversations), eval_fraction, split))
        if echo:
            print(f"chat data {source} ({split}, chat_loss={to_pieces.chat_loss}, seq_len={to_pieces.seq_len}, "
                  f"overflow={to_pieces.overflow}): {counts[split].summary()}", flush=True)
    return counts


def batch_summary(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Counts for logging: real tokens, trained tokens (``loss_mask`` on a target), padding fraction,
    pieces per row."""
    seg = batch["segment_ids"]
    real = int((seg > 0).sum())
    trained = int(((batch["loss_mask"] > 0) & (batch["targets"] >= 0)).sum())
    return {"tokens": real, "trained_tokens": trained, "padding_fraction": 1.0 - real / seg.size,
            "pieces_per_row": float(seg.max(axis=1).mean())}


__all__ = ["DocumentToPieces", "GuardedPieces", "IndexedDocuments", "batch_summary", "document_hash",
           "local_batch_size", "make_train_dataset", "report_chat_counts", "split_indices"]
