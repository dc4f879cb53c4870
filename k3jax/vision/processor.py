"""The image processor (numpy / PIL) and the placeholder block of an image in the token stream.

Follows the release's ``media_proc_cfg`` (its image preprocessing config; docs/design.md "Vision"):

1. scale ``s = min(1, sqrt(max_patches / (max(1, w // p) * max(1, h // p))), side * p / w,
   side * p / h)`` (``side = max_patches_per_side``), new size ``min(max(1, int(x * s)), side * p)``;
   never upscales;
2. bicubic resize; transparent pixels filled with a chessboard (8 px squares, white 255 / gray
   180, white top-left) after the resize;
3. pad right / bottom with black to multiples of ``p * m`` (so the grid merges ``m x m``);
4. pixels ``(x / 255 - mean) / std``; patches ``[gh * gw, 3, p, p]`` row-major over the grid.

An image becomes ``<|media_begin|>image {W}x{H}<|media_content|>`` + ``gh * gw / m^2`` x
``<|media_pad|>`` + ``<|media_end|>`` in the text (W x H: the original size).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Sequence

import numpy as np

from k3jax.config import VisionConfig

# transparent_bg_config of the release: a chessboard behind transparent pixels.
CHESS_SQUARE = 8
CHESS_LIGHT, CHESS_DARK = 255, 180
MAX_PIXEL = 255.0


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """patches ``[gh * gw, 3, p, p]`` float32; grid_hw ``(gh, gw)``; size_wh: the original (W, H)."""

    patches: np.ndarray
    grid_hw: tuple[int, int]
    size_wh: tuple[int, int]

    def num_tokens(self, merge_size: int) -> int:
        return (self.grid_hw[0] // merge_size) * (self.grid_hw[1] // merge_size)


def target_size(width: int, height: int, cfg: VisionConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized W, H), (padded W, H)) for an image of ``width x height`` pixels."""
    p, side = cfg.patch_size, cfg.max_patches_per_side
    scale = min(1.0, math.sqrt(cfg.max_patches / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    unit = p * cfg.merge_size
    return (new_w, new_h), (-(-new_w // unit) * unit, -(-new_h // unit) * unit)


def _chessboard(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[:height, :width]
    dark = ((y // CHESS_SQUARE) + (x // CHESS_SQUARE)) % 2 == 1
    return np.where(dark, CHESS_DARK, CHESS_LIGHT).astype(np.float32)[..., None]


def load_image(image) -> "PIL.Image.Image":  # noqa: F821
    """A PIL image from a path, a PIL image or a uint8 array ``[H, W, 3 | 4]`` (or ``[H, W]``)."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as im:
            im.load()
            return im.copy()
    if isinstance(image, np.ndarray):
        return Image.fromarray(np.asarray(image, np.uint8))
    return image


def process_image(image, cfg: VisionConfig) -> ProcessedImage:
    """Resize, fill transparency, pad, normalise and patchify one image (see the module docstring)."""
    from PIL import Image

    im = load_image(image)
    width, height = im.size
    has_alpha = im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)
    im = im.convert("RGBA" if has_alpha else "RGB")
    (new_w, new_h), (pad_w, pad_h) = target_size(width, height, cfg)
    if (new_w, new_h) != (width, height):
        im = im.resize((new_w, new_h), Image.BICUBIC)
    px = np.asarray(im, np.float32)
    if has_alpha:
        alpha = px[..., 3:] / MAX_PIXEL
        px = px[..., :3] * alpha + _chessboard(new_w, new_h) * (1.0 - alpha)
    canvas = np.zeros((pad_h, pad_w, 3), np.float32)
    canvas[:new_h, :new_w] = px
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    canvas = (canvas / MAX_PIXEL - mean) / std
    p = cfg.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = canvas.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return ProcessedImage(np.ascontiguousarray(patches), (gh, gw), (width, height))


def image_token_ids(image: ProcessedImage, cfg: VisionConfig, encode: Callable[[str], list[int]]) -> list[int]:
    """The placeholder block of one image: media_begin, ``encode("image WxH")``, media_content, one
    media_pad per LM image token, media_end."""
    w, h = image.size_wh
    return ([cfg.media_begin_id] + list(encode(f"image {w}x{h}")) + [cfg.media_content_id]
            + [cfg.media_pad_id] * image.num_tokens(cfg.merge_size) + [cfg.media_end_id])


def media_mask(tokens: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """True on every token of an image block (media_begin .. media_end inclusive), per row of
    ``tokens [..., T]``: positions whose prediction is not a language-modelling target."""
    tokens = np.asarray(tokens)
    begin = np.cumsum(tokens == cfg.media_begin_id, axis=-1)
    end = np.cumsum(tokens == cfg.media_end_id, axis=-1)
    # inside = opened more often than closed, or this token is the closing one
    return (begin > end) | (tokens == cfg.media_end_id)


def build_tokens(parts: Sequence, cfg: VisionConfig, encode: Callable[[str], list[int]]
                 ) -> tuple[list[int], list[ProcessedImage]]:
    """Interleaved text (``str``) and images (a ``pathlib.Path``, PIL image, uint8 array or
    ``ProcessedImage``; a ``str`` is always text) -> (token ids, the processed images in order)."""
    ids, images = [], []
    for part in parts:
        if isinstance(part, str):
            ids += list(encode(part))
            continue
        img = part if isinstance(part, ProcessedImage) else process_image(part, cfg)
        ids += image_token_ids(img, cfg, encode)
        images.append(img)
    return ids, images


__all__ = ["ProcessedImage", "build_tokens", "image_token_ids", "load_image", "media_mask", "process_image",
           "target_size"]
