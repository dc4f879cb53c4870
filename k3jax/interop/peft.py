"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Names and orientations come from the weights' HF bindings (``hf_names.bindings``): an adapted weight
``model.layers.3.self_attn.q_b_proj.weight`` gets ``base_model.model.model.layers.3.self_attn.q_b_proj
.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``, its adapters' blocks converted by the
weight's own conversion kind (``A [*in, r]`` is a weight whose output is ``r``, ``B [r, *out]`` one whose
input is ``r``). Module names are the ones transformers builds in memory (``hf_names.canonical_name``:
Kimi's ``block_sparse_moe.`` is ``mlp.``), which is what PEFT matches and loads.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from flax import nnx

from k3jax.runtime import storage
from k3jax.config import LoRAConfig
from k3jax.interop.hf_config import MODEL_TYPES
from k3jax.interop.hf_config_export import check_exportable
from k3jax.interop.hf_names import LANGUAGE_MODEL_PREFIX, LAYER_RE, LINEAR, LINEAR_IN2, Binding, bindings, block_to_hf, \
    canonical_name, hf_shape_of, hf_to_block
from k3jax.interop.model_leaves import Path, model_variables
from k3jax.interop.safetensors_io import SafetensorsFile, TensorSpec, write_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
WEIGHT_SUFFIX = ".weight"
FACTORS = (("a", "lora_A"), ("b", "lora_B"))  # k3jax adapter leaf, PEFT module
# Layouts whose routed experts transformers 5 fuses into one module that PEFT (0.21) retargets every
# ``gate_proj`` / ``up_proj`` / ``down_proj`` target to, even a full module name of the dense FFN or the
# shared experts: adapters on those cannot be written for PEFT there (merge them instead).
PEFT_FUSED_EXPERT_NAMES = {"deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
                           "kimi_k2": ("gate_proj", "up_proj", "down_proj")}


def adapter_leaf(weight: Path, factor: str) -> Path:
    """The path of a weight's adapter factor (``k3jax.layers.lora``: ``<module>.lora.<weight>.<a|b>``)."""
    return (*weight[:-1], "lora", weight[-1], factor)


def module_name(binding: Binding) -> str:
    """The transformers module of a weight binding, as named in memory (what PEFT matches)."""
    return canonical_name(binding.hf)[: -len(WEIGHT_SUFFIX)]


def _prefix(model_type: str) -> str:
    return LANGUAGE_MODEL_PREFIX if model_type == "kimi_k3" else ""


def _adaptable(model, model_type: str) -> list[Binding]:
    """The bindings of weights an adapter may sit on (projections, not routed experts)."""
    return [b for b in bindings(model.cfg, model.plan, model_type, _prefix(model_type))
            if b.kind in (LINEAR, LINEAR_IN2) and not b.expert]


def _target_modules(adapted: set[str], candidates: list[Binding], experts: list[str]) -> list[str]:
    """PEFT's ``target_modules``: the short names (``q_b_proj``) when they select exactly the adapted
    modules among every projection of the model (routed experts included), else the full names."""
    short = {name.rsplit(".", 1)[-1] for name in adapted}
    selected = {module_name(b) for b in candidates if module_name(b).rsplit(".", 1)[-1] in short}
    if selected == adapted and not any(e.rsplit(".", 1)[-1] in short for e in experts):
        return sorted(short)
    return sorted(adapted)


def save_peft(model, path: str | os.PathLike, *, model_type: str, base_model_name_or_path: str | None = None) -> dict:
    """Write ``model``'s LoRA adapters (``model.add_lora``) as a PEFT adapter directory for the HF model of
    ``model_type``'s layout; returns the adapter config written. The tensors are float32."""
    if storage.is_remote(path):  # a URL (gs://...): written locally, uploaded when complete
        with storage.staged_upload(path) as local:
            return save_peft(model, local, model_type=model_type, base_model_name_or_path=base_model_name_or_path)
    cfg: LoRAConfig | None = model.lora_config
    if cfg is None:
        raise ValueError("the model has no LoRA adapters to export (model.add_lora / a LoRA run's checkpoint)")
    check_exportable(model.cfg, model_type)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    variables = model_variables(model)
    candidates = _adaptable(model, model_type)
    specs, adapted = [], set()
    for b in candidates:
        if adapter_leaf(b.leaf, "a") not in variables:
            continue
        if module_name(b).rsplit(".", 1)[-1] in PEFT_FUSED_EXPERT_NAMES.get(model_type, ()):
            raise ValueError(f"{module_name(b)}: PEFT retargets {model_type}'s gate/up/down_proj adapters to the "
                             "fused routed experts, so adapters of the dense FFN and shared experts cannot be "
                             "exported for it; train with train.lora.targets=[mla], or merge the adapters "
                             "(python -m k3jax.convert --to-hf)")
        adapted.add(module_name(b))
        for factor, peft_name in FACTORS:
            var = variables[adapter_leaf(b.leaf, factor)]
            shape = hf_shape_of(b.kind, tuple(var.get_raw_value().shape[len(b.index):]), model.cfg, model_type)

            def produce(var=var, b=b, shape=shape):
                block = np.asarray(jax.device_get(var.get_raw_value()), np.float32)[b.index]
                return block_to_hf(b.kind, block, shape)

            specs.append(TensorSpec(f"{PEFT_PREFIX}{module_name(b)}.{peft_name}{WEIGHT_SUFFIX}", shape, np.float32,
                                    produce))
    # routed experts' bindings name the module (no ".weight"): transformers may hold them as one fused
    # module that PEFT would also match by these short names
    experts = [canonical_name(b.hf) for b in bindings(model.cfg, model.plan, model_type, _prefix(model_type))
               if b.expert]
    write_file(path / WEIGHTS_FILE, specs, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.use_rslora,
        "target_modules": _target_modules(adapted, candidates, experts), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return config


def is_peft_dir(path: str | os.PathLike) -> bool:
    path = storage.path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def load_peft(model, path: str | os.PathLike) -> None:
    """Attach the LoRA adapters of a PEFT adapter directory to ``model`` (a model without adapters, in
    place). Every tensor must land on a projection of the model (module names of any supported HF
    layout); weights the file does not adapt get ``B = 0`` adapters, which change nothing."""
    path = storage.local_copy(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    where = path / CONFIG_FILE
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, allowed in (("bias", ("none",)), ("fan_in_fan_out", (False,))):
        if raw.get(key, allowed[0]) not in allowed:
            raise ValueError(f"{where}: {key}={raw[key]!r} is not supported (only {allowed[0]!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise ValueError(f"{where}: {key} (per-module ranks / alphas) is not supported")
    with SafetensorsFile(path / WEIGHTS_FILE) as f:
        tensors = {name: f.get(name) for name in f.keys()}
    by_name = {}
    for model_type in MODEL_TYPES:  # the layouts differ only in prefixes; take the one naming every tensor
        names = {f"{PEFT_PREFIX}{module_name(b)}.{peft}{WEIGHT_SUFFIX}": (b, factor)
                 for b in _adaptable(model, model_type) for factor, peft in FACTORS}
        if set(tensors) <= set(names):
            by_name = names
            break
    unknown = sorted(set(tensors) - set(by_name)) if by_name else sorted(tensors)
    if unknown:
        raise ValueError(f"{path / WEIGHTS_FILE}: {len(unknown)} tensor(s) name no projection of this model "
                         f"(e.g. {unknown[0]})")
    rank = int(raw["r"])
    targets = set()  # the k3jax targets ("kind.weight") of the adapted weights
    for name in tensors:
        b, _ = by_name[name]
        layer = int(LAYER_RE.match(b.hf).group(1))
        kind = ("shared" if "shared" in b.leaf else "ffn") if "ffn" in b.leaf else model.cfg.mixer(layer)
        targets.add(f"{kind}.{b.leaf[-1]}")
    lora_cfg = LoRAConfig(rank=rank, alpha=float(raw["lora_alpha"]), dropout=float(raw.get("lora_dropout") or 0.0),
                          use_rslora=bool(raw.get("use_rslora", False)), targets=tuple(sorted(targets)))
    lora_cfg.validate(str(where))
    model.add_lora(lora_cfg, nnx.Rngs(0))
    variables = model_variables(model)
    host: dict[Path, np.ndarray] = {}
    for name, x in tensors.items():
        b, factor = by_name[name]
        leaf = adapter_leaf(b.leaf, factor)
        if leaf not in host:
            host[leaf] = np.zeros(variables[leaf].get_raw_value().shape, np.float32)
        try:
            host[leaf][b.index] = hf_to_block(b.kind, np.asarray(x, np.float32), host[leaf].shape[len(b.index):])
        except ValueError as e:
            raise ValueError(f"{path / WEIGHTS_FILE}: {name}: {e} (rank {rank})") from None
    for leaf, value in host.items():
        var = variables[leaf]
        var.set_raw_value(jax.device_put(value, var.get_raw_value().sharding))


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "adapter_leaf", "is_peft_dir", "load_peft", "module_name", "save_peft"]
