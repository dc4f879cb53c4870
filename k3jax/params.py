"""Parameter counts from the abstract model (nothing is allocated): ``python -m k3jax.params k3``.

Rule (docs/design.md "Parameter counting"): *total* is every parameter; *active* is what one token multiplies through, i.e.
everything except the routed experts it does not select (only ``top_k / num_experts`` of each routed
expert tensor counts) and the input embedding table (a lookup; counted when tied to the head).
The K2 report counts the embedding as active too; ``active_with_embedding`` gives that figure.
Weights are counted as weights whatever their storage: a model with MXFP4-packed experts
(``quant.experts=mxfp4``, two weights per byte plus scales) has the same counts as the bf16 one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from flax import nnx

from k3jax.config import ModelConfig, load_config
from k3jax.model import abstract_model

# Logical axis names that identify routed-expert weights and the input embedding table.
_ROUTED_EXPERT_AXIS = "expert_mlp"
_EMBED_PATH = ("embed",)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, experts="none"))  # storage-independent
    model = abstract_model(cfg)
    total = routed = embedding = 0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        n = math.prod(var.get_raw_value().shape)
        total += n
        if _ROUTED_EXPERT_AXIS in var.get_metadata().get("out_sharding", ()):
            routed += n
        if tuple(path) == _EMBED_PATH:
            embedding = n
    active_routed = routed * cfg.moe.top_k // cfg.moe.num_experts if routed else 0
    lookup_only = 0 if cfg.tie_embeddings else embedding
    active = total - routed + active_routed - lookup_only
    return {"total": total, "active": active, "active_with_embedding": active + lookup_only,
            "routed_experts": routed, "embedding": embedding}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="config name (configs/<name>.yaml) or path")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    print(json.dumps(count_params(cfg.model)))


if __name__ == "__main__":
    main()
