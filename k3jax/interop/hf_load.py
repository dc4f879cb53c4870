"""Loading a Hugging Face checkpoint directory into a k3jax model (``from_hf``), streaming.

The checkpoint is read shard by shard and tensor by tensor; each tensor is converted to its k3jax
block (:mod:`k3jax.interop.hf_names`) and written straight into its device array
(:mod:`k3jax.interop.placement`), so host memory holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from k3jax.runtime import storage
from k3jax.config import ModelConfig
from k3jax.interop import compressed_tensors, mxfp4
from k3jax.interop.hf_config import HFInfo, carry_config, config_from_hf
from k3jax.interop.hf_names import LANGUAGE_MODEL_PREFIX, LAYER_RE, SKIPPED, Binding, bindings, canonical_name, \
    hf_to_block, split_part
from k3jax.interop.model_leaves import Path, logical_shape, model_variables
from k3jax.interop.placement import PackedPlacer, as_rules, placer_for
from k3jax.interop.progress import progress_bar
from k3jax.interop.safetensors_io import SafetensorsFile
from k3jax.model import K3Model, abstract_model
from k3jax.quant.fp8_block import FP8BlockWeight, scale_shape as fp8_scale_shape
from k3jax.quant.int4 import Int4Weight
from k3jax.quant.storage import QuantizedWeight
from k3jax.vision.weights import is_vision_tensor, load_vision, official_names


def read_config(path: str | os.PathLike) -> dict:
    p = storage.path(path) / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return json.loads(storage.read_text(p))


def checkpoint_files(path: str | os.PathLike) -> dict[str, list[str]]:
    """``{shard file: [tensor names]}`` from ``model.safetensors.index.json`` or the single file(s)."""
    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, f in wm.items():
            files.setdefault(f, []).append(name)
        return dict(sorted(files.items()))
    single = sorted(p.name for p in path.glob("*.safetensors"))
    if not single:
        raise FileNotFoundError(f"{path}: no model.safetensors.index.json and no *.safetensors file")
    return {f: SafetensorsFile(path / f).keys() for f in single}


_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def _check_fp8_scale(name: str, w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> None:
    want = fp8_scale_shape(w.shape, block)
    if w.ndim != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not fit its weight {tuple(w.shape)} "
                         f"with weight_block_size {list(block)} (expected {want})")


def _dequant_fp8(name: str, w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek block fp8: ``W = fp8 * scale_inv`` broadcast over ``block`` tiles (edge tiles partial)."""
    _check_fp8_scale(name, w, scale_inv, block)
    bo, bi = block
    out, inn = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:out, :inn]
    return w.astype(np.float32) * s


def _kept_format(info: HFInfo, path) -> str:
    """The ``quant.experts`` value holding a checkpoint's quantized routed experts as they are stored."""
    if info.mxfp4:
        return "mxfp4"
    if info.int4 is not None:
        return "int4"
    if info.fp8_block is not None:
        return "fp8_block"
    raise ValueError(f"{path}: keep_quantized=True, but config.json has no quantization_config (nothing is compressed)")


# config.json's dtype names (transformers writes "dtype", earlier versions "torch_dtype") and the
# safetensors floating dtypes -> the dtype k3jax holds such weights in: its two parameter dtypes,
# float16 / float64 widened or narrowed to float32 (k3jax computes in float32 or bfloat16).
_LOAD_DTYPE = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float32", "float64": "float32",
               "BF16": "bfloat16", "F32": "float32", "F16": "float32", "F64": "float32"}


def checkpoint_dtype(path: str | os.PathLike) -> str:
    """The parameter dtype (``float32`` / ``bfloat16``) that keeps a HF checkpoint's weights as it stores
    them: config.json's ``dtype`` / ``torch_dtype``, else the floating dtype that holds most of the
    safetensors' bytes (read from the headers). Compressed experts (MXFP4, INT4, FP8) are not counted:
    they are kept in their own format (``keep_quantized``)."""
    path = storage.local_copy(path)
    hf = read_config(path)
    for key in ("dtype", "torch_dtype"):
        name = hf.get(key) or (hf.get("text_config") or {}).get(key)
        if name is not None:
            if str(name) not in _LOAD_DTYPE:
                raise ValueError(f"{path}/config.json: {key} {name!r} is not a floating dtype k3jax loads "
                                 f"({', '.join(k for k in _LOAD_DTYPE if k.islower())})")
            return _LOAD_DTYPE[str(name)]
    stored: dict[str, int] = {}
    for fname, names in checkpoint_files(path).items():
        f = SafetensorsFile(path / fname)
        for name in names:
            if f.dtype(name) in _LOAD_DTYPE:
                stored[f.dtype(name)] = stored.get(f.dtype(name), 0) + f.nbytes(name)
    if not stored:
        raise ValueError(f"{path}: config.json names no dtype and no safetensors tensor is floating point")
    return _LOAD_DTYPE[max(stored, key=stored.get)]


def compressed_experts(info: HFInfo) -> bool:
    """Whether the checkpoint stores its routed experts compressed (MXFP4, INT4 or block FP8)."""
    return info.mxfp4 or info.int4 is not None or info.fp8_block is not None


def load_hf_config(path: str | os.PathLike, *, dtype=jnp.float32, overrides=()) -> tuple[ModelConfig, HFInfo]:
    """The k3jax config (and import notes) of a HF model directory, without reading weights."""
    return config_from_hf(read_config(path), dtype=np.dtype(dtype).name, overrides=overrides)


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, rules=None,
            keep_mxfp4: bool = False, keep_quantized: bool = False, overrides: Sequence[str] = (),
            progress: bool = False) -> K3Model:
    """Load a local Hugging Face checkpoint (``kimi_k3``, ``kimi_linear``, ``deepseek_v3``, ``kimi_k2``,
    ``kimi_k25``; quantized releases: MXFP4 / INT4 (compressed-tensors) / block FP8 weights are decoded
    to ``dtype`` on load unless kept compressed).

    - ``dtype``: parameter and compute dtype (float32 or bfloat16); the leaves k3jax always keeps in
      float32 (router, A_log, dt_bias, router bias) stay float32.
    - ``mesh`` / ``rules``: place each leaf with ``NamedSharding(mesh, spec)``, the spec derived from
      the leaf's logical axis names by ``rules`` (``{logical: mesh_axis}`` or pairs; unmapped names
      replicated; the rule semantics of :mod:`k3jax.sharding`); ``rules=None``:
      ``k3jax.sharding.DEFAULT_RULES``, as train.py and infer.py place models.
    - ``keep_mxfp4``: MXFP4-packed routed experts stay packed: the model is built with
      ``quant.experts=mxfp4`` (also reachable through ``overrides``), its routed experts are
      :class:`~k3jax.quant.packed.MXFP4Weight` modules holding the checkpoint's bytes (4.25 bits per
      weight) that the forward pass dequantizes on the fly; ``to_hf`` writes them back byte for byte.
      Dense experts in the checkpoint are then quantized with ``quant.scale_rule``.
    - ``keep_quantized``: the routed experts stay in the checkpoint's compressed format, whichever it is
      (``quant.experts`` = ``mxfp4``, ``int4`` for compressed-tensors pack-quantized INT4 with the
      config's group size, ``fp8_block`` for DeepSeek fp8 with its ``weight_block_size``), dequantized
      in the forward pass; their storage is never trained (``k3jax.quant.storage``). Everything else
      (attention, shared experts, dense MLPs) is decoded to ``dtype``. The INT4 scales are stored in
      the parameter dtype.
    - ``overrides``: dotted ``key=value`` strings for the model config (``"kda.chunk_size=16"``).
    - ``progress``: show a tqdm bar.

    Returns the model; call it on int32 tokens ``[B, T]`` for ``(logits [B, T, V], cache)``. The
    config.json keys without effect on the maths (token ids, ...) stay on it for ``to_hf``
    (``hf_config.carry_config``).
    """
    path = storage.local_copy(path)  # a URL (gs://...): the directory downloaded once into the local cache
    cfg, info = load_hf_config(path, dtype=dtype,
                               overrides=[*overrides, *(["quant.experts=mxfp4"] if keep_mxfp4 else [])])
    if keep_quantized:
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, experts=_kept_format(info, path)))
        cfg.validate()
    keep_mxfp4 = cfg.quant.experts == "mxfp4"  # the packed structure, however it was asked for
    files = checkpoint_files(path)
    all_names = [n for names in files.values() for n in names]
    if any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in all_names):
        info.weight_prefix = LANGUAGE_MODEL_PREFIX
    model = abstract_model(cfg)
    variables = model_variables(model)
    compressed = {tuple(p): m for p, m in nnx.iter_graph(model) if isinstance(m, QuantizedWeight)}
    expected = bindings(cfg, model.plan, info.model_type, info.weight_prefix)
    by_name: dict[str, Binding] = {}
    for bnd in expected:
        if bnd.optional_leaf and bnd.leaf not in variables:
            continue
        by_name[canonical_name(bnd.hf + (".weight" if bnd.expert else ""))] = bnd

    table = None if mesh is None else as_rules(rules, mesh)
    placers: dict[Path, Any] = {}

    def placer(bnd: Binding):
        if bnd.leaf not in placers:
            if bnd.leaf in compressed:  # one placer per storage variable of the compressed weight
                n = len(bnd.leaf)
                placers[bnd.leaf] = PackedPlacer({p[n]: placer_for(v, mesh, table) for p, v in variables.items()
                                                  if len(p) == n + 1 and p[:n] == bnd.leaf})
            else:
                placers[bnd.leaf] = placer_for(variables[bnd.leaf], mesh, table)
        return placers[bnd.leaf]

    def block_shape(bnd: Binding):
        shape = compressed[bnd.leaf].shape if bnd.leaf in compressed else logical_shape(variables, bnd.leaf)
        return shape[len(bnd.index):]

    def put_compressed(bnd: Binding, **parts: np.ndarray) -> None:
        p = placer(bnd)
        for name, value in parts.items():
            p.parts[name].put(bnd.index, value)

    seen: set[str] = set()
    vision_tensors: dict[str, np.ndarray] = {}
    warned: list[bool] = []
    pending: dict[str, dict[str, np.ndarray]] = {}  # base name -> parts waiting for a partner
    unexpected: list[str] = []
    bar = progress_bar(len(all_names), f"loading {path.name}", progress)

    def consume(base: str, parts: dict[str, np.ndarray]) -> bool:
        """Place one complete tensor; False while a partner part is missing."""
        key = canonical_name(base)
        bnd = by_name.get(key)
        if bnd is None:
            unexpected.append(base)
            return True
        held = compressed.get(bnd.leaf)
        module = base.removesuffix(".weight")
        if info.int4 is not None and parts.keys() & {"packed", "scale", "shape"}:
            if not {"packed", "scale", "shape"} <= parts.keys():
                return False
            if not info.int4.quantizes(module):
                ignored = info.int4.ignored_by(module)
                why = f"its ignore list names it ({ignored!r})" if ignored else "its targets do not name it"
                raise ValueError(f"{module}: stored as INT4 (weight_packed), but quantization_config {why}")
            g = info.int4.group_size
            if isinstance(held, Int4Weight):
                compressed_tensors.check_shapes(module, parts["packed"], parts["scale"], parts["shape"], g)
                out_in = tuple(int(s) for s in parts["shape"])
                if out_in[::-1] != tuple(block_shape(bnd)):
                    raise ValueError(f"{module}: weight_shape {list(out_in)} does not fit k3jax leaf "
                                     f"{'.'.join(map(str, bnd.leaf))} slice {block_shape(bnd)} (as [out, in])")
                put_compressed(bnd, packed=parts["packed"], scale=parts["scale"])
                seen.add(key)
                return True
            value = compressed_tensors.decode(module, parts["packed"], parts["scale"], parts["shape"], g)
        elif "packed" in parts or "scale" in parts:
            if "packed" not in parts or "scale" not in parts:
                return False
            if keep_mxfp4 and bnd.expert:
                put_compressed(bnd, packed=parts["packed"], scale=parts["scale"])
                seen.add(key)
                return True
            value = mxfp4.decode(parts["packed"], parts["scale"], np.float32)
        else:
            if "value" not in parts:
                return False
            value = parts["value"]
            if value.dtype in _FP8:
                if "scale_inv" not in parts:
                    return False
                if info.fp8_block is None:
                    raise ValueError(f"{base}: float8 weight but config.json has no fp8 quantization_config")
                if isinstance(held, FP8BlockWeight):
                    _check_fp8_scale(base, value, parts["scale_inv"], info.fp8_block)
                    if value.shape[::-1] != tuple(block_shape(bnd)):
                        raise ValueError(f"{base}: shape {tuple(value.shape)} does not fit k3jax leaf "
                                         f"{'.'.join(map(str, bnd.leaf))} slice {block_shape(bnd)} (as [out, in])")
                    put_compressed(bnd, weight=value, scale_inv=parts["scale_inv"])
                    seen.add(key)
                    return True
                value = _dequant_fp8(base, value, parts["scale_inv"], info.fp8_block)
        if held is not None and not keep_mxfp4:
            raise ValueError(f"{base}: stored as {np.asarray(value).dtype} without its compressed form, but the model "
                             f"holds it compressed (quant.experts={cfg.quant.experts!r}); load without keep_quantized")
        try:
            blk = hf_to_block(bnd.kind, np.asarray(value), block_shape(bnd))
        except ValueError as err:
            raise ValueError(f"{base}: shape {tuple(np.shape(value))} does not fit k3jax leaf "
                             f"{'.'.join(map(str, bnd.leaf))} slice {block_shape(bnd)}: {err}") from None
        if keep_mxfp4 and bnd.expert:  # a dense expert read with keep_mxfp4: pack it (lossy unless on the grid)
            if not warned:
                warnings.warn(f"{path}: keep_mxfp4=True but the routed experts are stored dense; they are "
                              "quantized to MXFP4 on load", stacklevel=3)
                warned.append(True)
            packed, scale = mxfp4.encode(np.swapaxes(blk, -1, -2), rule=cfg.quant.scale_rule)
            put_compressed(bnd, packed=packed, scale=scale)
        else:
            placer(bnd).put(bnd.index, blk)
        seen.add(key)
        return True

    for fname, names in files.items():
        with SafetensorsFile(path / fname) as f:
            in_file = set(names)
            for name in f.keys():
                if name not in in_file:
                    continue
                if bar is not None:
                    bar.update(1)
                if cfg.vision.enabled and is_vision_tensor(name):
                    vision_tensors[name] = f.get(name)  # small next to the LM: placed at the end
                    continue
                if any(p.search(name) for p in SKIPPED):
                    continue
                if cfg.tie_embeddings and name.endswith("lm_head.weight"):
                    continue  # a tied head saved anyway
                m = LAYER_RE.match(name)
                if m and int(m.group(1)) >= cfg.num_layers:
                    if info.num_mtp_layers:
                        continue  # an MTP module stored as an extra layer (warned in config_from_hf)
                    unexpected.append(name)
                    continue
                base, part = split_part(name)
                parts = pending.pop(base, {})
                parts[part] = f.get(name)
                if not consume(base, parts):
                    pending[base] = parts
        if unexpected:  # fail at the first shard that holds something the model has no place for
            raise ValueError(f"{path}/{fname}: {len(unexpected)} tensors have no place in the {info.model_type} "
                             f"model (first: {unexpected[:10]})")
    if bar is not None:
        bar.close()
    if pending:
        raise ValueError(f"{path}: incomplete tensors (missing packed/scale or fp8 scale partner): {sorted(pending)[:10]}")
    missing = sorted(set(by_name) - seen)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing from the checkpoint (first: {missing[:10]})")
    for leaf_path, p in placers.items():
        if isinstance(p, PackedPlacer):
            for name, part in p.parts.items():
                variables[leaf_path + (name,)].set_raw_value(part.value)
        else:
            variables[leaf_path].set_raw_value(p.value)
    if cfg.vision.enabled:  # vision_tower.* / mm_projector.*: replicated (the tower runs data-parallel)
        missing = sorted(set(official_names(model)) - set(vision_tensors))
        if missing:
            raise ValueError(f"{path}: {len(missing)} vision tensors missing from the checkpoint (first: {missing[:10]})")
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
        load_vision(model, vision_tensors.__getitem__,
                    put=None if replicated is None else (lambda a: jax.device_put(a, replicated)))
    absent = [p for p, v in variables.items() if isinstance(v.get_raw_value(), jax.ShapeDtypeStruct)]
    if absent:
        raise AssertionError(f"leaves left unfilled: {absent[:10]}")
    carry_config(model, info.extra)
    return model


__all__ = ["checkpoint_dtype", "checkpoint_files", "compressed_experts", "from_hf", "load_hf_config", "read_config"]
