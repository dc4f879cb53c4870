"""The vision tower's input: the patches of every image of a batch row, packed without padding.

Each row of a batch owns a fixed budget of ``P`` patch slots; its images' patches are laid end to
end (each image row-major over its patch grid) and the rest is padding. Per-patch integers tell the
tower which image a patch belongs to (block-diagonal attention), where it sits (position table and
2-D RoPE) and how the ``m x m`` merge regroups them; all are computed here on the host, so the
jitted tower has static shapes whatever the image sizes.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class VisionInputs(NamedTuple):
    """Packed images of a batch; every field has the batch axis first (``B`` rows).

    patches ``[B, P, C, p, p]`` float32 normalised pixels; segment_ids ``[B, P]`` int32 (1, 2, ...
    per image of the row, 0 = padding); rows / cols ``[B, P]`` int32 patch coordinates; grid_h /
    grid_w ``[B, P]`` int32 the image's patch grid (1 in padding); merge_index ``[B, M, m*m]`` int32:
    the patch slots forming LM token j of the row, sub-patches in (kh, kw) row-major order;
    merged_valid ``[B, M]`` bool. LM token j of a row replaces the row's j-th ``<|media_pad|>``.
    """

    patches: np.ndarray
    segment_ids: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    grid_h: np.ndarray
    grid_w: np.ndarray
    merge_index: np.ndarray
    merged_valid: np.ndarray


def num_merged_tokens(grid_hw: tuple[int, int], merge_size: int) -> int:
    """LM tokens of one image: ``(h / m) * (w / m)``."""
    h, w = grid_hw
    return (h // merge_size) * (w // merge_size)


def pack_images(rows_of_images: Sequence[Sequence], merge_size: int, *, max_patches: int | None = None,
                patch_shape: tuple[int, int, int] | None = None) -> VisionInputs:
    """Pack ``ProcessedImage``s (``k3jax.vision.processor``; anything with ``patches [n, C, p, p]`` and
    ``grid_hw``) into a :class:`VisionInputs`, one batch row per inner sequence (which may be empty).

    max_patches: the per-row patch budget ``P`` (default: the largest row's need, at least one slot);
    ``M = P / m^2``. patch_shape ``(C, p, p)`` is needed only when no row has an image.
    """
    mm = merge_size * merge_size
    need = [sum(int(img.patches.shape[0]) for img in imgs) for imgs in rows_of_images]
    if max_patches is None:
        max_patches = max([mm] + need)
        max_patches = -(-max_patches // mm) * mm
    if max_patches % mm:
        raise ValueError(f"max_patches={max_patches} must be a multiple of merge_size^2={mm}")
    over = [(i, n) for i, n in enumerate(need) if n > max_patches]
    if over:
        raise ValueError(f"row {over[0][0]} has {over[0][1]} patches, more than max_patches={max_patches}")
    if patch_shape is None:
        shapes = [img.patches.shape[1:] for imgs in rows_of_images for img in imgs]
        if not shapes:
            raise ValueError("pack_images: no images; pass patch_shape=(C, p, p)")
        patch_shape = tuple(shapes[0])
    b, p, m = len(rows_of_images), max_patches, max_patches // mm
    out = VisionInputs(
        patches=np.zeros((b, p) + tuple(patch_shape), np.float32),
        segment_ids=np.zeros((b, p), np.int32), rows=np.zeros((b, p), np.int32), cols=np.zeros((b, p), np.int32),
        grid_h=np.ones((b, p), np.int32), grid_w=np.ones((b, p), np.int32),
        merge_index=np.zeros((b, m, mm), np.int32), merged_valid=np.zeros((b, m), bool))
    for r, imgs in enumerate(rows_of_images):
        offset = merged = 0
        for seg, img in enumerate(imgs, start=1):
            h, w = img.grid_hw
            if h % merge_size or w % merge_size:
                raise ValueError(f"image grid {h}x{w} is not a multiple of merge_size={merge_size}")
            n = h * w
            out.patches[r, offset:offset + n] = img.patches
            out.segment_ids[r, offset:offset + n] = seg
            rr, cc = np.divmod(np.arange(n), w)
            out.rows[r, offset:offset + n], out.cols[r, offset:offset + n] = rr, cc
            out.grid_h[r, offset:offset + n], out.grid_w[r, offset:offset + n] = h, w
            # Merged token (i, j) takes patches (m i + kh, m j + kw), (kh, kw) row-major.
            i, kh, j, kw = np.meshgrid(np.arange(h // merge_size), np.arange(merge_size),
                                       np.arange(w // merge_size), np.arange(merge_size), indexing="ij")
            idx = offset + (merge_size * i + kh) * w + merge_size * j + kw  # [h/m, m, w/m, m]
            k = num_merged_tokens((h, w), merge_size)
            out.merge_index[r, merged:merged + k] = idx.transpose(0, 2, 1, 3).reshape(k, mm)
            out.merged_valid[r, merged:merged + k] = True
            offset, merged = offset + n, merged + k
    return out


__all__ = ["VisionInputs", "num_merged_tokens", "pack_images"]
