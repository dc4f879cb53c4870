"""Image-text training data: records ``{"image": ..., "text": caption}`` -> rows of tokens + packed patches.

``make_multimodal_dataset(train_cfg, vision_cfg, tokenizer)`` returns a checkpointable
``grain.IterDataset`` of numpy batches holding the text keys of ``k3jax.data.pipeline`` (``tokens,
segment_ids, positions, targets, loss_mask``, ``[B, T]``) plus the fields of
``k3jax.vision.inputs.VisionInputs`` under ``image_<field>`` (``[B, P, ...]``, ``P =
vision.max_patches`` slots per row). Each record is one row: ``[bos] + image block + caption +
[eos]``, shifted into (inputs, targets), cut to ``seq_len`` (the image block must fit whole),
padded. Targets inside an image block (media_begin .. media_end) are not predicted: ``loss_mask`` is
0 there, as in padding.

The bundled set (``source: bundled``) is generated, not stored: :class:`SyntheticCaptions` draws a
coloured shape on a coloured background at a random size and captions it ("a red circle on a blue
background"), a deterministic function of the record index, so it costs no files and a model can
only get the caption right by looking at the image.
"""

from __future__ import annotations

from typing import Literal

import grain
import numpy as np

from k3jax.config import Config, TrainConfig, VisionConfig
from k3jax.data.pipeline import IndexedDocuments, local_batch_size, make_train_dataset, split_indices
from k3jax.tokenizer import TextTokenizer
from k3jax.vision.inputs import VisionInputs, pack_images
from k3jax.vision.processor import image_token_ids, media_mask, process_image

IMAGE_KEY_PREFIX = "image_"
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
          "white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle")
SYNTHETIC_SIZE = (24, 64)  # min / max side in pixels of the generated images
SYNTHETIC_COUNT = 512


def draw_shape(shape: str, fg: tuple[int, int, int], bg: tuple[int, int, int], width: int, height: int,
               rng: np.random.Generator) -> np.ndarray:
    """A ``[H, W, 3]`` uint8 image: one filled ``shape`` of colour ``fg`` on ``bg``, placed at random."""
    img = np.empty((height, width, 3), np.uint8)
    img[:] = bg
    r = rng.uniform(0.25, 0.4) * min(width, height)
    cy, cx = rng.uniform(r, height - r), rng.uniform(r, width - r)
    y, x = np.mgrid[:height, :width] + 0.5
    if shape == "circle":
        inside = (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(y - cy) <= r) & (np.abs(x - cx) <= r)
    else:  # upward triangle: below the two slanted edges, above the base
        inside = (y <= cy + r) & (np.abs(x - cx) <= (y - (cy - r)) * 0.6)
    img[inside] = fg
    return img


class SyntheticCaptions:
    """``n`` generated image-caption records (random access; record i is the same on every call)."""

    def __init__(self, n: int = SYNTHETIC_COUNT, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, int(index)])
        names = list(COLORS)
        fg, bg = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[rng.integers(len(SHAPES))]
        w, h = (int(v) for v in rng.integers(SYNTHETIC_SIZE[0], SYNTHETIC_SIZE[1] + 1, 2))
        image = draw_shape(shape, COLORS[names[fg]], COLORS[names[bg]], w, h, rng)
        return {"image": image, "text": f"a {names[fg]} {shape} on a {names[bg]} background"}

    def __repr__(self) -> str:
        return f"SyntheticCaptions(n={self.n}, seed={self.seed})"


class RecordToExample(grain.transforms.Map):
    """``{"image", "text"}`` -> one padded row (text keys ``[T]``) + its processed image."""

    def __init__(self, tokenizer: TextTokenizer, vision: VisionConfig, seq_len: int):
        self.tokenizer, self.vision, self.seq_len = tokenizer, vision, seq_len

    def map(self, record: dict) -> dict:
        tok, t = self.tokenizer, self.seq_len
        img = process_image(record["image"], self.vision)
        block = image_token_ids(img, self.vision, tok.encode)
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + block + tok.encode(record["text"])
        ids += [tok.eos_id] if tok.eos_id is not None else []
        if len(block) > t:
            raise ValueError(f"an image block of {len(block)} tokens does not fit train.seq_len={t}; lower "
                             "model.vision.max_patches or raise seq_len")
        arr = np.asarray(ids[:t + 1], np.int32)
        n = len(arr) - 1
        row = {"tokens": np.zeros(t, np.int32), "segment_ids": np.zeros(t, np.int32),
               "positions": np.zeros(t, np.int32), "targets": np.full(t, -1, np.int32),
               "loss_mask": np.zeros(t, np.float32)}
        row["tokens"][:n], row["targets"][:n] = arr[:-1], arr[1:]
        row["segment_ids"][:n], row["positions"][:n] = 1, np.arange(n)
        row["loss_mask"][:n] = ~media_mask(arr[1:], self.vision)
        return {"row": row, "image": img}


def _collate(examples: list[dict], batch: int, seq_len: int, vision: VisionConfig) -> dict[str, np.ndarray]:
    rows = [e["row"] for e in examples]
    images = [[e["image"]] for e in examples]
    empty = {"tokens": np.zeros(seq_len, np.int32), "segment_ids": np.zeros(seq_len, np.int32),
             "positions": np.zeros(seq_len, np.int32), "targets": np.full(seq_len, -1, np.int32),
             "loss_mask": np.zeros(seq_len, np.float32)}
    rows += [empty] * (batch - len(rows))
    images += [[] for _ in range(batch - len(images))]
    out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    p = vision.patch_size
    packed = pack_images(images, vision.merge_size, max_patches=vision.max_patches, patch_shape=(3, p, p))
    out.update({IMAGE_KEY_PREFIX + k: v for k, v in packed._asdict().items()})
    return out


def vision_batch(batch: dict) -> VisionInputs | None:
    """The ``VisionInputs`` of a batch dict (``image_*`` keys), or None for a text-only batch."""
    if IMAGE_KEY_PREFIX + "patches" not in batch:
        return None
    return VisionInputs(**{f: batch[IMAGE_KEY_PREFIX + f] for f in VisionInputs._fields})


def make_multimodal_dataset(train_cfg: TrainConfig, vision: VisionConfig, tokenizer: TextTokenizer, *,
                            split: Literal["train", "eval"] = "train", process_index: int = 0,
                            process_count: int = 1, records=None) -> grain.IterDataset:
    """Batches of image-caption rows (module docstring). records: a random-access source of
    ``{"image": path | PIL image | uint8 array, "text": str}``; default the bundled synthetic set."""
    records = SyntheticCaptions(seed=0) if records is None else records
    batch, seq_len, seed = local_batch_size(train_cfg, process_count), train_cfg.seq_len, train_cfg.seed
    indices = split_indices(len(records), train_cfg.data.eval_fraction, split)
    if len(indices) == 0:
        raise ValueError(f"the {split} split of the image-caption records is empty ({len(records)} records)")
    ds = grain.MapDataset.source(IndexedDocuments(records, indices))
    ds = ds[process_index::process_count]
    train = split == "train"
    if train and train_cfg.data.shuffle:
        ds = ds.shuffle(seed=seed)
    if train:
        ds = ds.repeat(train_cfg.data.num_epochs)
    ds = ds.map(RecordToExample(tokenizer, vision, seq_len))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return it.batch(batch, drop_remainder=train, batch_fn=lambda ex: _collate(ex, batch, seq_len, vision))


def make_dataset(cfg: Config, tokenizer: TextTokenizer, *, split: Literal["train", "eval"] = "train",
                 process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
    """The run's dataset: image-caption rows for a vision model (the bundled synthetic set), packed
    text or chat otherwise (``k3jax.data.pipeline.make_train_dataset``)."""
    if not cfg.model.vision.enabled:
        return make_train_dataset(cfg.train, tokenizer, split=split, process_index=process_index,
                                  process_count=process_count)
    if cfg.train.data.format == "chat":
        raise ValueError("train.data.format=chat: chat data trains a text model; a vision model trains on "
                         "image-caption records")
    if cfg.train.data.source != "bundled":
        raise ValueError(f"train.data.source={cfg.train.data.source!r}: a vision model trains on the bundled "
                         "image-caption set ('bundled'); other image sources: make_multimodal_dataset(records=...)")
    return make_multimodal_dataset(cfg.train, cfg.model.vision, tokenizer, split=split,
                                   process_index=process_index, process_count=process_count)


__all__ = ["IMAGE_KEY_PREFIX", "RecordToExample", "SyntheticCaptions", "draw_shape", "make_dataset",
           "make_multimodal_dataset", "vision_batch"]
