"""Hugging Face checkpoints <-> k3jax models: the tensor name/orientation map, streaming load
(``from_hf``) and sharded export (``to_hf``).

Orientation: HF stores every matrix as a torch ``nn.Linear`` weight ``[out, in]``; k3jax stores
``x @ W`` weights ``(in, out)`` with explicit head axes, e.g. ``q_proj (d, H, K)`` <- HF
``[H*K, d]``, ``o_proj (H, K, d)`` <- HF ``[d, H*K]``, depthwise convs ``(W, H, K)`` <- HF
``[H*K, 1, W]``. Scanned layers are stacked (``model.groups``, leading group axis) and routed
experts carry an expert axis, so one HF tensor fills one slice ``leaf[g, e, ...]`` of a leaf.

Loading is streaming: the checkpoint is read shard by shard and tensor by tensor, and every slice
is written straight into its (possibly sharded) device array with an in-place, donated
``dynamic_update_slice``; host memory holds one tensor at a time, never a second copy of the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import warnings
import weakref
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.interop import mxfp4
from k3jax.interop.hf_config import HFInfo, check_exportable, config_from_hf, config_to_hf
from k3jax.interop.safetensors_io import SafetensorsFile, TensorSpec, parse_size, write_file
from k3jax.layer_plan import LayerPlan
from k3jax.model import K3Model, abstract_model
from k3jax.sharding import DEFAULT_RULES, logical_to_spec
from k3jax.vision.weights import export_vision, is_vision_tensor, load_vision, official_names

Path = tuple  # a path of attribute names / list indices into the model graph

# Conversion kinds between an HF tensor and a k3jax block (the leaf minus its indexed leading axes).
SAME = "same"  # identical shape
FLAT = "flat"  # HF [prod(shape)] <-> block (dt_bias [H*K] <-> (H, K))
ROW = "row"  # HF [1, d] <-> (d,) (AttnRes pseudo-queries, an nn.Linear(d, 1))
LINEAR = "linear"  # HF [out, in] <-> (in, *out): projections into heads
LINEAR_IN2 = "linear_in2"  # HF [out, in] <-> (*in(2 axes), out): o_proj (H, K, d)
CONV = "conv"  # HF [C, 1, W] <-> (W, H, K)
A_LOG = "a_log"  # HF [1, 1, H, 1] (kimi_linear) or zero-padded [max(K, H)] (kimi_k3) <-> (H,)

LANGUAGE_MODEL_PREFIX = "language_model."
# Keys of the imported config.json without effect on the maths (token ids, ...), per loaded model,
# so that ``to_hf`` writes them back; keyed by id() with a weak reference to the model.
_HF_EXTRA: dict[int, tuple[weakref.ref, dict]] = {}


@dataclasses.dataclass(frozen=True)
class Binding:
    """One HF tensor <-> one slice of one k3jax leaf."""

    hf: str  # HF name (with prefix); for packed experts the base name without ".weight"
    leaf: Path  # path of the nnx.Variable in the model
    index: tuple[int, ...]  # leading indices into the leaf
    kind: str
    expert: bool = False  # a routed-expert matrix (may be MXFP4-packed)
    optional_leaf: bool = False  # the leaf may be absent (router bias): export zeros, ignore on import


def _family(model_type: str) -> str:
    return "deepseek" if model_type in ("deepseek_v3", "kimi_k2") else "kimi"


def bindings(cfg: ModelConfig, plan: LayerPlan, model_type: str, prefix: str = "") -> list[Binding]:
    """Every HF tensor of ``model_type``'s layout for a model with config ``cfg``, in file order."""
    fam = _family(model_type)
    out: list[Binding] = []
    top = prefix + "model."
    out.append(Binding(top + "embed_tokens.weight", ("embed",), (), SAME))
    for i in range(cfg.num_layers):
        base, idx = plan.locate(i)
        L = f"{top}layers.{i}."

        def b(name, sub, kind, extra=(), **kw):
            out.append(Binding(L + name, base + sub, idx + extra, kind, **kw))

        b("input_layernorm.weight", ("attn_norm", "weight"), SAME)
        b("post_attention_layernorm.weight", ("ffn_norm", "weight"), SAME)
        if cfg.attn_res.enabled:
            b("self_attention_res_proj.weight", ("attn_res_mix", "query"), ROW)
            b("self_attention_res_norm.weight", ("attn_res_mix", "norm"), SAME)
            b("mlp_res_proj.weight", ("ffn_res_mix", "query"), ROW)
            b("mlp_res_norm.weight", ("ffn_res_mix", "norm"), SAME)
        A = "self_attn."
        if cfg.mixer(i) == "kda":
            for x in "qkv":
                b(f"{A}{x}_proj.weight", ("mixer", f"{x}_proj"), LINEAR)
            for x in "qkv":
                b(f"{A}{x}_conv1d.weight", ("mixer", f"{x}_conv"), CONV)
            b(A + "f_a_proj.weight", ("mixer", "f_a"), LINEAR)
            b(A + "f_b_proj.weight", ("mixer", "f_b"), LINEAR)
            b(A + "A_log", ("mixer", "A_log"), A_LOG)
            b(A + "dt_bias", ("mixer", "dt_bias"), FLAT)
            b(A + "b_proj.weight", ("mixer", "b_proj"), LINEAR)
            if cfg.kda.output_gate == "full":
                b(A + "g_proj.weight", ("mixer", "g_proj"), LINEAR)
            elif cfg.kda.output_gate == "low_rank":
                b(A + "g_a_proj.weight", ("mixer", "g_a"), LINEAR)
                b(A + "g_b_proj.weight", ("mixer", "g_b"), LINEAR)
            b(A + "o_norm.weight", ("mixer", "o_norm"), SAME)
            b(A + "o_proj.weight", ("mixer", "o_proj"), LINEAR_IN2)
        else:
            if cfg.mla.q_lora_rank:
                b(A + "q_a_proj.weight", ("mixer", "q_a"), LINEAR)
                b(A + "q_a_layernorm.weight", ("mixer", "q_a_norm", "weight"), SAME)
                b(A + "q_b_proj.weight", ("mixer", "q_b"), LINEAR)
            else:
                b(A + "q_proj.weight", ("mixer", "q_proj"), LINEAR)
            b(A + "kv_a_proj_with_mqa.weight", ("mixer", "kv_a"), LINEAR)
            b(A + "kv_a_layernorm.weight", ("mixer", "kv_a_norm", "weight"), SAME)
            b(A + "kv_b_proj.weight", ("mixer", "kv_b"), LINEAR)
            if cfg.mla.output_gate:
                b(A + "g_proj.weight", ("mixer", "g_proj"), LINEAR)
            b(A + "o_proj.weight", ("mixer", "o_proj"), LINEAR_IN2)
        if cfg.ffn(i) == "dense":
            for x in ("gate", "up", "down"):
                b(f"mlp.{x}_proj.weight", ("ffn", f"w_{x}"), LINEAR)
        else:
            M = "block_sparse_moe." if fam == "kimi" else "mlp."
            b(M + "gate.weight", ("ffn", "router"), LINEAR)
            b(M + "gate.e_score_correction_bias", ("ffn", "router_bias"), SAME, optional_leaf=True)
            if cfg.moe.latent_dim:
                b(M + "routed_expert_down_proj.weight", ("ffn", "down"), LINEAR)
                b(M + "routed_expert_up_proj.weight", ("ffn", "up"), LINEAR)
                if cfg.moe.latent_norm:
                    b(M + "routed_expert_norm.weight", ("ffn", "latent_norm", "weight"), SAME)
            names = ({"w_gate": "w1", "w_down": "w2", "w_up": "w3"} if fam == "kimi"
                     else {"w_gate": "gate_proj", "w_down": "down_proj", "w_up": "up_proj"})
            for e in range(cfg.moe.num_experts):
                for leaf, hf in names.items():
                    b(f"{M}experts.{e}.{hf}", ("ffn", leaf), LINEAR, (e,), expert=True)
            if cfg.moe.num_shared_experts:
                for x in ("gate", "up", "down"):
                    b(f"{M}shared_experts.{x}_proj.weight", ("ffn", "shared", f"w_{x}"), LINEAR)
    out.append(Binding(top + "norm.weight", ("final_norm", "weight"), (), SAME))
    if cfg.attn_res.enabled:
        out.append(Binding(top + "output_attn_res_proj.weight", ("final_res_mix", "query"), (), ROW))
        out.append(Binding(top + "output_attn_res_norm.weight", ("final_res_mix", "norm"), (), SAME))
    if not cfg.tie_embeddings:
        out.append(Binding(prefix + "lm_head.weight", ("lm_head",), (), LINEAR))
    return out


# ---------------------------------------------------------------------------------------------
# Orientation conversions


def hf_to_block(kind: str, x: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor -> the k3jax block of shape ``block_shape``."""
    if kind in (SAME, FLAT, ROW):
        if math.prod(x.shape) != math.prod(block_shape) or (kind == SAME and x.shape != block_shape):
            raise ValueError(f"expected {block_shape}, got {x.shape}")
        return x.reshape(block_shape)
    if kind in (LINEAR, LINEAR_IN2):
        if x.ndim != 2:
            raise ValueError(f"expected a 2-D linear weight, got shape {x.shape}")
        return x.T.reshape(block_shape)
    if kind == CONV:
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"expected a depthwise conv weight [C, 1, W], got shape {x.shape}")
        return x[:, 0, :].T.reshape(block_shape)
    if kind == A_LOG:
        (h,) = block_shape
        flat = x.reshape(-1)
        if flat.shape[0] < h:
            raise ValueError(f"A_log has {flat.shape[0]} entries, need {h} (one per head)")
        if np.any(flat[h:].astype(np.float32) != 0):
            warnings.warn(f"A_log holds {flat.shape[0]} entries with nonzero padding beyond the first {h} heads; "
                          "only the first num_heads are used", stacklevel=4)
        return flat[:h]
    raise ValueError(kind)


def block_to_hf(kind: str, x: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
    """A k3jax block -> the HF tensor of shape ``hf_shape``."""
    if kind in (SAME, FLAT, ROW):
        return x.reshape(hf_shape)
    if kind == LINEAR:
        return x.reshape(x.shape[0], -1).T.reshape(hf_shape)
    if kind == LINEAR_IN2:
        return x.reshape(-1, x.shape[-1]).T.reshape(hf_shape)
    if kind == CONV:
        return x.reshape(x.shape[0], -1).T[:, None, :].reshape(hf_shape)
    if kind == A_LOG:
        out = np.zeros(math.prod(hf_shape), x.dtype)
        out[: x.shape[0]] = x
        return out.reshape(hf_shape)
    raise ValueError(kind)


def hf_shape_of(kind: str, block_shape: tuple[int, ...], model_type: str) -> tuple[int, ...]:
    if kind == SAME:
        return tuple(block_shape)
    if kind == FLAT:
        return (math.prod(block_shape),)
    if kind == ROW:
        return (1, math.prod(block_shape))
    if kind == LINEAR:
        return (math.prod(block_shape[1:]), block_shape[0])
    if kind == LINEAR_IN2:
        return (block_shape[-1], math.prod(block_shape[:-1]))
    if kind == CONV:
        return (math.prod(block_shape[1:]), 1, block_shape[0])
    if kind == A_LOG:
        raise AssertionError("A_log's HF shape depends on the head dim; see _a_log_shape")
    raise ValueError(kind)


def _a_log_shape(cfg: ModelConfig, model_type: str) -> tuple[int, ...]:
    h = cfg.kda.num_heads
    if model_type == "kimi_k3":
        return (max(cfg.kda.head_dim, h),)  # the release zero-pads A_log to [head_dim]
    return (1, 1, h, 1)


# ---------------------------------------------------------------------------------------------
# Reading checkpoints


def read_config(path: str | os.PathLike) -> dict:
    p = pathlib.Path(path) / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return json.loads(p.read_text())


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
_SKIP = [re.compile(p) for p in (r"(^|\.)rotary_emb\.", r"^vision_tower\.", r"^mm_projector\.",
                                  r"^(language_model\.)?mtp\.", r"^model\.mtp\.")]
_LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")


def _canonical(name: str) -> str:
    """Aliases collapse to one spelling: transformers' in-memory ``forget_gate.`` submodule, and
    ``block_sparse_moe.`` vs ``mlp.`` (transformers 5 saves Kimi Linear's dense layer 0 as
    ``block_sparse_moe.gate_proj``, the hub has ``mlp.gate_proj``)."""
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    return name.replace(".block_sparse_moe.", ".mlp.")


def _split_part(name: str) -> tuple[str, str]:
    """``x.weight_packed`` / ``x.weight_scale`` (MXFP4) / ``x.weight_scale_inv`` (fp8) ->
    (``x.weight``, part); any other name -> (name, "value")."""
    for suffix, part in ((".weight_packed", "packed"), (".weight_scale_inv", "scale_inv"), (".weight_scale", "scale")):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", part
    return name, "value"


def _dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek block fp8: ``W = fp8 * scale_inv`` broadcast over ``block`` tiles."""
    bo, bi = block
    out, inn = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:out, :inn]
    return w.astype(np.float32) * s


# ---------------------------------------------------------------------------------------------
# Placement on devices


def partition_spec(axes: Sequence[str | None] | None, rules, shape: tuple[int, ...], mesh) -> jax.sharding.PartitionSpec:
    """Logical axis names -> PartitionSpec by ``rules`` (mapping or (logical, mesh axis) pairs);
    unmapped names are replicated; a mesh axis is used at most once and only where it divides."""
    P = jax.sharding.PartitionSpec
    if not axes or rules is None:
        return P()
    table = dict(rules.items() if isinstance(rules, Mapping) else rules)
    used, spec = set(), []
    for dim, name in zip(shape, axes):
        m = table.get(name)
        names = () if m is None else (m if isinstance(m, tuple) else (m,))
        bad = [a for a in names if a not in mesh.shape]
        if bad:
            raise ValueError(f"sharding rule {name!r} -> {m!r}: mesh has no axis {bad[0]!r} (axes: {tuple(mesh.shape)})")
        size = math.prod(mesh.shape[a] for a in names) if names else 1
        if not names or any(a in used for a in names) or dim % size:
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return P(*spec)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding):
    def update(arr, block, *idx):
        block = block.reshape((1,) * len(idx) + block.shape)
        return jax.lax.dynamic_update_slice(arr, block.astype(arr.dtype), tuple(idx) + (0,) * (block.ndim - len(idx)))

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


class _Placer:
    """Fills one leaf: whole (``device_put``) or slice by slice (in-place donated update)."""

    def __init__(self, shape, dtype, mesh, spec):
        self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)
        self.mesh, self.spec = mesh, spec
        self.sharding = jax.sharding.NamedSharding(mesh, spec) if mesh is not None else None
        self.value = None

    def _block_sharding(self, n_idx):
        if self.mesh is None:
            return None
        rest = tuple(self.spec) + (None,) * (len(self.shape) - len(self.spec))
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*rest[n_idx:]))

    def put(self, index: tuple[int, ...], block: np.ndarray) -> None:
        block = np.asarray(block).astype(self.dtype, copy=False)
        if not index:
            self.value = jax.device_put(block, self.sharding) if self.sharding is not None else jnp.asarray(block)
            return
        if self.value is None:
            self.value = _zeros_fn(self.shape, self.dtype, self.sharding)()
        dev = jax.device_put(block, self._block_sharding(len(index))) if self.mesh is not None else block
        idx = [np.int32(i) for i in index]
        self.value = _update_fn(self.sharding)(self.value, dev, *idx)


class _PackedPlacer:
    """A routed-expert weight kept as MXFP4 (``k3jax.quant.packed.MXFP4Weight``): fills its ``packed``
    and ``scale`` variables (HF orientation), each placed by its own logical axes."""

    def __init__(self, packed: _Placer, scale: _Placer):
        self.packed, self.scale = packed, scale


def _iter_variables(model) -> dict[Path, nnx.Variable]:
    return {tuple(p): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}


def _packed_parts(variables: dict[Path, nnx.Variable], leaf: Path) -> tuple[nnx.Variable, nnx.Variable] | None:
    """The (packed, scale) variables of an ``MXFP4Weight`` at ``leaf``, or None for a dense leaf."""
    packed, scale = variables.get(leaf + ("packed",)), variables.get(leaf + ("scale",))
    return None if packed is None or scale is None else (packed, scale)


def _logical_shape(variables: dict[Path, nnx.Variable], leaf: Path) -> tuple[int, ...]:
    """The dense k3jax shape of ``leaf`` (``(..., in, out)`` for a packed weight)."""
    parts = _packed_parts(variables, leaf)
    if parts is None:
        return tuple(variables[leaf].get_raw_value().shape)
    return mxfp4.PackedMXFP4(parts[0].get_raw_value(), parts[1].get_raw_value()).logical_shape


def _progress(total: int, desc: str, enabled):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor")


def load_hf_config(path: str | os.PathLike, *, dtype=jnp.float32, overrides=()) -> tuple[ModelConfig, HFInfo]:
    """The k3jax config (and import notes) of a HF model directory, without reading weights."""
    hf = read_config(path)
    cfg, info = config_from_hf(hf, dtype=np.dtype(dtype).name, overrides=overrides)
    return cfg, info


def from_hf(path: str | os.PathLike, *, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, rules=None,
            keep_mxfp4: bool = False, overrides: Sequence[str] = (), progress: bool = False) -> K3Model:
    """Load a local Hugging Face checkpoint (``kimi_k3``, ``kimi_linear``, ``deepseek_v3``, ``kimi_k2``).

    - ``dtype``: parameter and compute dtype (float32 or bfloat16); the leaves k3jax always keeps in
      float32 (router, A_log, dt_bias, router bias) stay float32.
    - ``mesh`` / ``rules``: place each leaf with ``NamedSharding(mesh, spec)``, the spec derived from
      the leaf's logical axis names by ``rules`` (``{logical: mesh_axis}`` or pairs; unmapped names
      replicated); ``rules=None``: ``k3jax.sharding.DEFAULT_RULES``.
    - ``keep_mxfp4``: MXFP4-packed routed experts stay packed: the model is built with
      ``quant.experts=mxfp4`` (also reachable through ``overrides``), its routed experts are
      :class:`~k3jax.quant.packed.MXFP4Weight` modules holding the checkpoint's bytes (4.25 bits per
      weight) that the forward pass dequantizes on the fly; ``to_hf`` writes them back byte for byte.
      Dense experts in the checkpoint are then quantized with ``quant.scale_rule``.
    - ``overrides``: dotted ``key=value`` strings for the model config (``"kda.chunk_size=16"``).
    - ``progress``: show a tqdm bar.

    Returns the model; call it on int32 tokens ``[B, T]`` for ``(logits [B, T, V], cache)``.
    """
    path = pathlib.Path(path)
    hf = read_config(path)
    cfg, info = config_from_hf(hf, dtype=np.dtype(dtype).name,
                               overrides=[*overrides, *(["quant.experts=mxfp4"] if keep_mxfp4 else [])])
    keep_mxfp4 = cfg.quant.experts == "mxfp4"  # the packed structure, however it was asked for
    files = checkpoint_files(path)
    all_names = [n for names in files.values() for n in names]
    if any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in all_names):
        info.weight_prefix = LANGUAGE_MODEL_PREFIX
    model = abstract_model(cfg)
    variables = _iter_variables(model)
    expected = bindings(cfg, model.plan, info.model_type, info.weight_prefix)
    by_name: dict[str, Binding] = {}
    for bnd in expected:
        if bnd.optional_leaf and bnd.leaf not in variables:
            continue
        by_name[_canonical(bnd.hf + (".weight" if bnd.expert else ""))] = bnd

    placers: dict[Path, Any] = {}

    def leaf_placer(var: nnx.Variable) -> _Placer:
        sds = var.get_raw_value()
        axes = var.get_metadata().get("out_sharding")
        if mesh is None:
            spec = None
        elif rules is None:  # the framework's rules (k3jax.sharding), as train.py and infer.py place models
            spec = logical_to_spec(axes, DEFAULT_RULES, mesh, sds.shape) if axes else jax.sharding.PartitionSpec()
        else:
            spec = partition_spec(axes, rules, sds.shape, mesh)
        return _Placer(sds.shape, sds.dtype, mesh, spec)

    def placer(bnd: Binding):
        if bnd.leaf not in placers:
            parts = _packed_parts(variables, bnd.leaf)
            placers[bnd.leaf] = leaf_placer(variables[bnd.leaf]) if parts is None else \
                _PackedPlacer(*(leaf_placer(v) for v in parts))
        return placers[bnd.leaf]

    def block_shape(bnd: Binding):
        return _logical_shape(variables, bnd.leaf)[len(bnd.index):]

    seen: set[str] = set()
    vision_tensors: dict[str, np.ndarray] = {}
    warned: list[bool] = []
    pending: dict[str, dict[str, np.ndarray]] = {}  # base name -> parts waiting for a partner
    unexpected: list[str] = []
    bar = _progress(len(all_names), f"loading {path.name}", progress)

    def consume(base: str, parts: dict[str, np.ndarray]) -> bool:
        """Place one complete tensor; False while a partner part is missing."""
        key = _canonical(base)
        bnd = by_name.get(key)
        if bnd is None:
            unexpected.append(base)
            return True
        if "packed" in parts or "scale" in parts:
            if "packed" not in parts or "scale" not in parts:
                return False
            if keep_mxfp4 and bnd.expert:
                p = placer(bnd)
                p.packed.put(bnd.index, parts["packed"])
                p.scale.put(bnd.index, parts["scale"])
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
                value = _dequant_fp8(value, parts["scale_inv"], info.fp8_block)
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
            p = placer(bnd)
            p.packed.put(bnd.index, packed)
            p.scale.put(bnd.index, scale)
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
                if any(p.search(name) for p in _SKIP):
                    continue
                if cfg.tie_embeddings and name.endswith("lm_head.weight"):
                    continue  # a tied head saved anyway
                m = _LAYER_RE.match(name)
                if m and int(m.group(1)) >= cfg.num_layers:
                    if info.num_mtp_layers:
                        continue  # an MTP module stored as an extra layer (warned in config_from_hf)
                    unexpected.append(name)
                    continue
                base, part = _split_part(name)
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
        if isinstance(p, _PackedPlacer):
            for name, part in (("packed", p.packed), ("scale", p.scale)):
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
    _HF_EXTRA[id(model)] = (weakref.ref(model), dict(info.extra))
    return model


def hf_extra(model) -> dict:
    """The carried config.json keys (token ids, ...) of a model loaded by ``from_hf`` ({} otherwise)."""
    ref, extra = _HF_EXTRA.get(id(model), (None, {}))
    return dict(extra) if ref is not None and ref() is model else {}


# ---------------------------------------------------------------------------------------------
# Export


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
        parts = _packed_parts(self.variables, leaf)
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
    cfg: ModelConfig = model.cfg
    check_exportable(cfg, model_type)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    variables = _iter_variables(model)
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
        if bnd.leaf not in variables and _packed_parts(variables, bnd.leaf) is None:
            return None
        return _logical_shape(variables, bnd.leaf)[len(bnd.index):]

    def tensor_dtype(name, leaf_dtype):
        if out_dtype is None or not _is_float(leaf_dtype):
            return np.dtype(leaf_dtype)
        if keep_f32.search(name):
            return np.dtype(np.float32)
        return out_dtype

    for bnd in bindings(cfg, model.plan, model_type, prefix):
        var = variables.get(bnd.leaf)
        packed_leaf = _packed_parts(variables, bnd.leaf) is not None
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
        hf_shape = _a_log_shape(cfg, model_type) if bnd.kind == A_LOG else hf_shape_of(bnd.kind, bshape, model_type)
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
    bar = _progress(len(specs), f"writing {path.name}", progress)
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
    extra = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **hf_extra(model),
             **(extra_config or {})}
    hf_cfg = config_to_hf(cfg, model_type, mxfp4=bool(mxfp4_experts), extra=extra, dtype=dtype_field)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    return hf_cfg


__all__ = ["Binding", "bindings", "checkpoint_files", "from_hf", "hf_extra", "load_hf_config", "partition_spec", "read_config",
           "to_hf"]
