"""The RL rollout / trainer mismatch with and without routing replay, with the trainer computing in float32 and
in bfloat16; prints one JSON document.

    python bench/rl_mismatch.py                                    # tiny MoE, random weights (~3 min)
    python bench/rl_mismatch.py --config tiny_rl --prompts bundled # the RL demo's policy (runs/chat_lora)

The recording serving engine (``k3jax.serving.engine``, as an RL run builds it: the model's scanned arrays,
``record_routes``) samples ``--group`` completions of ``--prompts-n`` prompts at temperature 1, computing in
float32; the scoring forward (``k3jax.rl.step.make_score_fn``, the trainer's whole-row forward) recomputes the
sampled tokens' log-probabilities on the same weights, with the rollout's experts replayed and without (its
own top-k), computing in each ``--trainer-dtypes`` (``model.dtype``). Figures per side
(``k3jax.rl.mismatch``): KL(rollout || trainer) by k1 and k3, the largest |Δ log p|, the Pearson correlation
of token probabilities, and without replay the fraction of routing decisions (token, MoE layer, expert) that
differ from the rollout's. In float32 on a CPU the two sides come out alike; a bfloat16 trainer against a
float32 sampler is the kind of gap replay is for (a sampler and a trainer with other kernels and precisions).
The engine itself cannot compute in bfloat16 on a CPU: XLA:CPU has no BF16 x BF16 -> F32 dot for the MLA
cache attention.
"""

from __future__ import annotations

import argparse
import json
import time

import common  # noqa: F401  (pins the CPU, compile cache; before jax)
import numpy as np
from flax import nnx

from k3jax.config import load_config
from k3jax.model import moe_layers
from k3jax.rl.mismatch import logprob_mismatch, routing_disagreement
from k3jax.rl.prompts import open_prompts, prompt_ids
from k3jax.rl.rollout import rollout_seed, sample, training_rows
from k3jax.rl.step import make_score_fn
from k3jax.serving.engine import Engine
from k3jax.tokenizer import load_tokenizer
from k3jax.training.step import init_train_state
from k3jax.training.trainer import init_weights_from

TINY_MOE = ["model.num_layers=2", "model.attn_res.block_size=1", "train.seq_len=96", "train.rl.loss=grpo"]
TEXT_PROMPTS = ["In the beginning", "And God said, Let", "The LORD is my", "Blessed are the", "For God so loved",
                "Then Jesus said", "And the earth was", "Now the serpent"]


def measure(config: str, overrides: list[str], trainer_dtype: str, args) -> dict:
    settings = [*overrides, "train.rl.measure_mismatch=true", "train.rl.routing_replay=true",
                "train.rl.temperature=1.0", f"train.rl.max_new_tokens={args.new_tokens}",
                f"train.rl.group_size={args.group}", f"train.rl.prompts_per_step={args.prompts_n}",
                f"train.batch_size={args.group * args.prompts_n}"]
    cfg = load_config(config, [*settings, "model.dtype=float32"])
    trainer_cfg = load_config(config, [*settings, f"model.dtype={trainer_dtype}"])
    if not moe_layers(cfg.model):
        raise SystemExit(f"{config}: no MoE layer, nothing to replay")
    ts = init_train_state(cfg)
    if cfg.train.init_from:
        init_weights_from(ts.model, cfg.train.init_from)
    graphdef, state = nnx.split(ts)
    trainer_graphdef = nnx.graphdef(init_train_state(trainer_cfg))  # the same weights, another compute dtype
    tokenizer = load_tokenizer(cfg.train.data.tokenizer)
    if args.prompts == "text":
        prompts = [tokenizer.encode(p) for p in TEXT_PROMPTS[:args.prompts_n]]
    else:
        records = open_prompts(args.prompts, split="train", eval_fraction=cfg.train.rl.eval_fraction,
                               pattern=cfg.train.rl.prompt_pattern)
        prompts = [prompt_ids(tokenizer, records[i]) for i in range(args.prompts_n)]
    rows = len(prompts) * args.group
    max_len = max(map(len, prompts)) + args.new_tokens + 1
    engine = Engine(nnx.merge(graphdef, state).model, max_batch=rows, max_len=max_len, prefill_batch=rows,
                    unroll_layers=False, record_routes=True, layout="training")
    t0 = time.perf_counter()
    completions = sample(engine, prompts, args.group, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0,
                         stop_ids=(), seeds=[rollout_seed(0, 0, i) for i in range(rows)])
    rollout_s = time.perf_counter() - t0
    batch = training_rows(completions, max_len - 1, cfg.model.moe.top_k, len(moe_layers(cfg.model)))
    scored = {k: np.asarray(v) for k, v in make_score_fn(trainer_graphdef, trainer_cfg)(state, batch).items()}
    real = batch["segment_ids"] > 0
    return {"rows": rows, "sampled_tokens": int(batch["mask"].sum()), "rollout_s": round(rollout_s, 2),
            "with_replay": logprob_mismatch(batch["rollout_logp"], scored["logp"], batch["mask"]),
            "without_replay": {**logprob_mismatch(batch["rollout_logp"], scored["free_logp"], batch["mask"]),
                               "routing_disagreement": routing_disagreement(batch["routes"], scored["free_routes"],
                                                                            real)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", help="a named config or YAML (train.init_from is loaded)")
    parser.add_argument("--prompts", default="text", help="'text' (a few verse openings) or train.rl.prompts' form")
    parser.add_argument("--prompts-n", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--trainer-dtypes", default="float32,bfloat16")
    parser.add_argument("overrides", nargs="*", help="config overrides (default for tiny: a 2-layer MoE)")
    args = parser.parse_args()
    overrides = args.overrides or (TINY_MOE if args.config == "tiny" else [])
    report = {"bench": "rl_mismatch", "config": args.config, "overrides": overrides, **common.cpu_info()}
    for dtype in args.trainer_dtypes.split(","):
        common.log(f"trainer in {dtype} ...")
        report[f"trainer_{dtype}"] = measure(args.config, overrides, dtype, args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
