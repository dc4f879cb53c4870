"""Deployment of MXFP4 experts: a dense (e.g. QAT-trained) model -> the same model with its routed
experts packed, and the memory the packed experts take.

It lives in ``interop``, above the model in the layering, because it is a transform of whole models
(it builds the packed model and copies every variable across by path, as ``from_hf`` does when it
keeps MXFP4 experts packed); ``k3jax.quant`` stays below the layers, holding only the formats and
the packed weight itself.

``python -m k3jax.interop.packed_experts k3`` prints the routed-expert bytes of a config packed vs
bfloat16 and the whole model's weight bytes with bfloat16 dense weights and packed experts (from
the abstract model; nothing is allocated). ``k3jax.aot`` reports the compiled decode memory of the
same model with ``quant.experts=mxfp4`` among its overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig, load_config
from k3jax.interop.model_leaves import model_variables
from k3jax.model import K3Model, abstract_model
from k3jax.quant.mxfp4 import quantize_mxfp4
from k3jax.quant.packed import MXFP4Bytes, MXFP4Weight

BF16_BYTES = 2


def packed_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its routed experts held packed (``quant.experts=mxfp4``), everything else equal."""
    return dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, experts="mxfp4"))


def to_packed(model: K3Model, *, rule: str | None = None) -> K3Model:
    """A new model with ``model``'s weights and its routed experts packed as MXFP4.

    ``rule``: the scale rule (default ``model.cfg.quant.scale_rule``, the rule a QAT model was trained
    with, so the packed model computes exactly what the QAT forward pass computed). Experts that
    are already packed are copied as they are.
    """
    cfg = model.cfg
    rule = cfg.quant.scale_rule if rule is None else rule
    packed = abstract_model(packed_config(cfg))
    src = model_variables(model)
    for path, module in nnx.iter_graph(packed):
        if isinstance(module, MXFP4Weight) and tuple(path) in src:  # a dense expert weight to pack
            w = src[tuple(path)].get_raw_value()
            codes, scale = quantize_mxfp4(jnp.swapaxes(w, -1, -2), rule=rule)
            module.packed.set_raw_value(codes)
            module.scale.set_raw_value(scale)
    for path, var in model_variables(packed).items():
        if isinstance(var.get_raw_value(), jax.ShapeDtypeStruct):
            if path not in src:
                raise KeyError(f"{path}: no such variable in the source model")
            var.set_raw_value(src[path].get_raw_value())
    return packed


def expert_memory(cfg: ModelConfig) -> dict[str, float]:
    """Bytes of the routed experts and of all weights of ``cfg``, packed vs bfloat16.

    ``routed_params``: routed-expert weights; ``routed_bf16_bytes`` / ``routed_mxfp4_bytes``: their
    storage as bfloat16 / as MXFP4 (packed codes + E8M0 scales, 4.25 bits each); ``ratio`` the
    quotient (17/64); ``model_bf16_bytes``: every weight in bfloat16 (float32 state such as the router
    bias counted as float32); ``model_mxfp4_bytes``: the same with the experts packed.
    """
    packed = abstract_model(packed_config(dataclasses.replace(cfg, param_dtype="bfloat16")))
    routed_params = packed_bytes = other_bytes = 0
    for path, module in nnx.iter_graph(packed):
        if isinstance(module, MXFP4Weight):
            routed_params += math.prod(module.shape)
    for var in model_variables(packed).values():
        value = var.get_raw_value()
        nbytes = math.prod(value.shape) * jnp.dtype(value.dtype).itemsize
        if isinstance(var, MXFP4Bytes):
            packed_bytes += nbytes
        else:
            other_bytes += nbytes
    routed_bf16 = routed_params * BF16_BYTES
    return {"routed_params": routed_params, "routed_bf16_bytes": routed_bf16, "routed_mxfp4_bytes": packed_bytes,
            "ratio": packed_bytes / routed_bf16 if routed_bf16 else float("nan"),
            "model_bf16_bytes": other_bytes + routed_bf16, "model_mxfp4_bytes": other_bytes + packed_bytes}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="routed-expert memory of a config: MXFP4 packed vs bfloat16")
    ap.add_argument("config", help="config name (configs/<name>.yaml) or path")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = ap.parse_args(argv)
    print(json.dumps(expert_memory(load_config(args.config, args.overrides).model)))


__all__ = ["expert_memory", "packed_config", "to_packed"]

if __name__ == "__main__":
    main()
