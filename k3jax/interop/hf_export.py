"""Writing a k3jax model as a Hugging Face checkpoint directory in an official layout (``to_hf``).

Tensors are produced lazily, one at a time, from host copies of the leaves (:class:`_LeafReader`
keeps at most a byte budget of them), and written into safetensors shards of a bounded size.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.runtime import storage
from k3jax.config import ModelConfig
from k3jax.interop import mxfp4
from k3jax.interop.hf_config import carried_config
from k3jax.interop.hf_config_export import check_exportable, config_to_hf
from k3jax.interop.hf_names import LANGUAGE_MODEL_PREFIX, bindings, block_to_hf, hf_shape_of
from k3jax.interop.model_leaves import Path, logical_shape, model_variables, packed_parts
from k3jax.interop.progress import progress_bar
from k3jax.interop.safetensors_io import TensorSpec, parse_size, write_file
from k3jax.model import K3Model
from k3jax.vision.weights import export_vision


# Tensors the official layouts keep in float32 when the rest is written in a lower precision.
_KEEP_F32 = {
    "kimi_k3": re.compile(r"(_conv1d\.weight|\.A_log|\.dt_bias|\.o_norm\.weight|\.e_score_correction_bias)$"),
    "kimi_linear": re.compile(r"(_conv1d\.weight|\.A_log|\.dt_bias|\.o_norm\.weight|\.e_score_correction_bias|\.gate\.weight)$"),
    "deepseek_v3": re.compile(r"(\.e_score_correction_bias|\.gate\.weight)$"),
}
_KEEP_F32["kimi_k2"] = _KEEP_F32["deepseek_v3"]


def _is_float(dt) -> bool:
    dt = np.dtype(dt)
    return dt.kind == "f" or dt.name.startswith(("bfloat", "float"))


class _LeafReader:
    """Host copies of leaf slices, fetching each leaf at most once while it fits a byte budget."""

    def __init__(self, variables: dict[Path, nnx.Variable], budget: int = 1 << 30):
        self.variables, self.budget = variables, budget
        self.cache: dict[Path, np.ndarray] = {}
        self.used = 0

    def get(self, leaf: Path, index: tuple[int, ...]) -> Any:
        parts = packed_parts(self.variables, leaf)
        if parts is not None:  # an MXFP4Weight: its bytes, as a host PackedMXFP4
            return mxfp4.PackedMXFP4(*(self._get(leaf + (name,), v.get_raw_value(), index)
                                       for name, v in zip(("packed", "scale"), parts)))
        return self._get(leaf, self.variables[leaf].get_raw_value(), index)

    def _get(self, leaf, value, index):
        if leaf in self.cache:
            return self.cache[leaf][index]
        nbytes = value.size * value.dtype.itemsize
        if self.used + nbytes <= self.budget:
            host = np.asarray(jax.device_get(value))
            self.cache[leaf] = host
            self.used += nbytes
            return host[index]
        # too large to cache: fetch just this slice
        return np.asarray(jax.device_get(_take_fn(len(index))(value, *[np.int32(i) for i in index])))


@functools.lru_cache(maxsize=None)
def _take_fn(n):
    def take(arr, *idx):
        for i in idx:
            arr = jax.lax.dynamic_index_in_dim(arr, i, 0, keepdims=False)
        return arr

    return jax.jit(take)


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def to_hf(model: K3Model, path: str | os.PathLike, *, model_type: str = "kimi_k3", max_shard_size: int | str = "5GB",
          dtype=None, mxfp4_experts: bool | None = None, mxfp4_rule: str | None = None,
          extra_config: dict | None = None, progress: bool = False) -> dict:
    """Write ``model`` as a Hugging Face checkpoint directory in the official ``model_type`` layout.

    - ``dtype``: None keeps each leaf's dtype (exact round trip); a float dtype (e.g.
      ``jnp.bfloat16``) casts floating tensors except those the official layout keeps in float32.
    - ``mxfp4_experts`` (kimi_k3 only; default: True for kimi_k3 when the experts are held packed,
      ``quant.experts=mxfp4``, else False): write routed experts as ``weight_packed`` /
      ``weight_scale`` (the release layout, with its ``quantization_config``), quantizing dense
      experts with ``mxfp4_rule`` (default: the model's ``quant.scale_rule``, the rule its QAT
      forward pass used, so the export holds exactly the values the model was trained with).
    - ``extra_config``: keys with no effect on the maths (token ids, ...) added to config.json;
      default: those of the config the model was loaded from (token ids left unknown are written
      as null, so that HF does not substitute the full-size release's ids).

    Writes ``config.json``, the safetensors shard(s) and, when sharded,
    ``model.safetensors.index.json``. Returns the config dict written.
    """
    if storage.is_remote(path):  # a URL (gs://...): written locally, uploaded when complete
        with storage.staged_upload(path) as local:
            return to_hf(model, local, model_type=model_type, max_shard_size=max_shard_size, dtype=dtype,
                         mxfp4_experts=mxfp4_experts, mxfp4_rule=mxfp4_rule, extra_config=extra_config,
                         progress=progress)
    cfg: ModelConfig = model.cfg
    check_exportable(cfg, model_type)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    variables = model_variables(model)
    if cfg.quant.experts in ("int4", "fp8_block"):
        raise ValueError(f"the model holds its routed experts as {cfg.quant.experts} (quant.experts); to_hf writes "
                         "dense or MXFP4 experts: load the checkpoint without keep_quantized to export it")
    packed_leaves = cfg.quant.experts == "mxfp4"
    mxfp4_rule = cfg.quant.scale_rule if mxfp4_rule is None else mxfp4_rule
    if mxfp4_experts is None:
        mxfp4_experts = model_type == "kimi_k3" and packed_leaves
    if packed_leaves and not mxfp4_experts:
        raise ValueError("the model holds MXFP4-packed experts; export them with mxfp4_experts=True (kimi_k3)")
    prefix = LANGUAGE_MODEL_PREFIX if model_type == "kimi_k3" else ""
    keep_f32 = _KEEP_F32[model_type]
    out_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    reader = _LeafReader(variables)
    specs: list[TensorSpec] = []
    encoded: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def leaf_shape(bnd):
        if bnd.leaf not in variables and packed_parts(variables, bnd.leaf) is None:
            return None
        return logical_shape(variables, bnd.leaf)[len(bnd.index):]

    def tensor_dtype(name, leaf_dtype):
        if out_dtype is None or not _is_float(leaf_dtype):
            return np.dtype(leaf_dtype)
        if keep_f32.search(name):
            return np.dtype(np.float32)
        return out_dtype

    for bnd in bindings(cfg, model.plan, model_type, prefix):
        var = variables.get(bnd.leaf)
        packed_leaf = packed_parts(variables, bnd.leaf) is not None
        if var is None and not packed_leaf:
            if not bnd.optional_leaf:
                raise KeyError(f"model has no leaf {bnd.leaf} for {bnd.hf}")
            e = cfg.moe.num_experts  # no router bias: the HF layout always has one; zeros change nothing
            specs.append(TensorSpec(bnd.hf, (e,), np.float32, lambda e=e: np.zeros((e,), np.float32)))
            continue
        bshape = leaf_shape(bnd)
        leaf_dtype = np.uint8 if packed_leaf else var.get_raw_value().dtype
        if bnd.expert and mxfp4_experts:
            n_in, n_out = bshape

            def pair(bnd=bnd):
                if bnd.hf not in encoded:
                    encoded.clear()  # one expert matrix at a time
                    v = reader.get(bnd.leaf, bnd.index)
                    if isinstance(v, mxfp4.PackedMXFP4):
                        encoded[bnd.hf] = (np.asarray(v.packed), np.asarray(v.scale))
                    else:
                        encoded[bnd.hf] = mxfp4.encode(np.asarray(v, np.float32).T, rule=mxfp4_rule)
                return encoded[bnd.hf]

            specs.append(TensorSpec(bnd.hf + ".weight_packed", (n_out, n_in // 2), np.uint8, lambda p=pair: p()[0]))
            specs.append(TensorSpec(bnd.hf + ".weight_scale", (n_out, n_in // mxfp4.GROUP_SIZE), np.uint8,
                                    lambda p=pair: p()[1]))
            continue
        if packed_leaf:
            raise ValueError(f"{bnd.leaf}: packed MXFP4 leaf cannot be written dense; pass mxfp4_experts=True")
        name = bnd.hf + (".weight" if bnd.expert else "")
        hf_shape = hf_shape_of(bnd.kind, bshape, cfg, model_type)
        dt = tensor_dtype(name, leaf_dtype)

        def produce(bnd=bnd, hf_shape=hf_shape, dt=dt):
            block = np.asarray(reader.get(bnd.leaf, bnd.index))
            return block_to_hf(bnd.kind, block, hf_shape).astype(dt)

        specs.append(TensorSpec(name, hf_shape, dt, produce))

    if cfg.vision.enabled:  # vision_tower.* / mm_projector.* in the release layout (k3jax/vision/weights.py)
        for vname, arr in export_vision(model):
            vdt = tensor_dtype(vname, arr.dtype)
            specs.append(TensorSpec(vname, arr.shape, vdt, lambda a=arr, vdt=vdt: a.astype(vdt)))

    # Shards: consecutive tensors up to max_shard_size bytes each.
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    names = _shard_names(len(shards))
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    bar = progress_bar(len(specs), f"writing {path.name}", progress)
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        total += write_file(path / fname, shard, on_tensor=(lambda s: bar.update(1)) if bar is not None else None)
        weight_map.update({s.name: fname for s in shard})
    if bar is not None:
        bar.close()
    if len(shards) > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    dtype_field = np.dtype(out_dtype if out_dtype is not None else cfg.param_dtype).name
    extra = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **carried_config(model),
             **(extra_config or {})}
    hf_cfg = config_to_hf(cfg, model_type, mxfp4=bool(mxfp4_experts), extra=extra, dtype=dtype_field)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    return hf_cfg




__all__ = ["to_hf"]
