"""Parameter counts of a config (nothing is built): ``python -m k3jax.params k3``.

Rule (docs/design.md "Parameter counting", the formulas in ``k3jax.aot.analytic``): *total* is every
parameter; *active* is what one token multiplies through, i.e. everything except the routed experts it
does not select (only ``top_k / num_experts`` of each routed expert tensor counts) and the input
embedding table (a lookup; counted when tied to the head). The K2 report counts the embedding as active
too; ``active_with_embedding`` gives that figure. Weights are counted as weights whatever their storage:
a model with MXFP4-packed experts (``quant.experts=mxfp4``, two weights per byte plus scales) has the
same counts as the bf16 one. ``--by-part`` adds the counts per part.
"""

from __future__ import annotations

import argparse
import json

from k3jax.aot import analytic
from k3jax.config import ModelConfig, load_config


def count_params(cfg: ModelConfig) -> dict[str, int]:
    total = analytic.params_by_part(cfg)
    active = sum(analytic.active_params_by_part(cfg).values())
    lookup_only = 0 if cfg.tie_embeddings else total["embedding"]
    return {"total": sum(total.values()), "active": active, "active_with_embedding": active + lookup_only,
            "routed_experts": total.get("routed_experts", 0), "embedding": total["embedding"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="config name (configs/<name>.yaml) or path")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ap.add_argument("--by-part", action="store_true", help="also the total and active counts per part")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    counts = count_params(cfg.model)
    if args.by_part:
        lora = cfg.train.lora if cfg.train.lora.enabled else None
        counts |= {"by_part": analytic.params_by_part(cfg.model, lora),
                   "active_by_part": analytic.active_params_by_part(cfg.model, lora)}
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
