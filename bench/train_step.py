"""Training-step throughput on CPU, k3jax against HF transformers; prints one JSON document.

    python bench/train_step.py           # `small` config, 4 x 256 tokens per step (~10 min on 2 busy cores)
    python bench/train_step.py --quick   # smoke run: `tiny`, 2 x 32 tokens, XLA optimisations off

Timed in the same process, interleaved step by step (so that load from other processes hits all
of them alike), after one warm-up step; the k3jax compile is timed on its own (``lower().compile()``).
Medians over ``--repeats``, and the best repeat (least disturbed by other load; ``load_average``
says how busy the machine was):

- ``k3jax_<config>``: the step ``train.py`` runs (``k3jax.training.make_train_step``: forward,
  backward, per-head Muon + AdamW, Quantile Balancing, NaN guard) on the config itself;
- ``hf_kimi_linear``: ``transformers.KimiLinearForCausalLM`` forward with labels, ``backward()``,
  ``torch.optim.AdamW.step()``, on a Kimi Linear config of the same size (``common.hf_kimi_linear_config``:
  same widths, depth, layer layout, heads, experts; routed-expert and shared-expert parameters and
  FLOPs per token equal; the K3-only parts - latent projections, gates, AttnRes - are the rest of
  the parameter difference, reported), torch reference kernels (fla / causal_conv1d not installed);
- ``k3jax_kimi_linear`` (unless ``--no-same-weights``): k3jax's step on that same HF model loaded
  with ``from_hf``: same architecture and weights as the HF model, so that ratio is like for like
  except for the optimizer (Muon + AdamW vs AdamW).

Tokens per step are equal for all: ``batch x seq_len`` input tokens (HF shifts its labels inside,
so it scores ``seq_len - 1`` of them per row, k3jax ``seq_len``). Float32 everywhere; random tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

# common first: it pins JAX to the CPU before jax is imported
from common import cpu_info, hf_kimi_linear_config, log, median, randomize_torch, timed, torch_param_counts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.config import load_config  # noqa: E402
from k3jax.interop import from_hf  # noqa: E402
from k3jax.model import create_model  # noqa: E402
from k3jax.optim import make_optimizer  # noqa: E402
from k3jax.params import count_params  # noqa: E402
from k3jax.training import TrainState, make_train_step  # noqa: E402

# HF AdamW settings (the AdamW side of k3jax's optimizer uses the config's own)
HF_LEARNING_RATE = 1e-3
HF_WEIGHT_DECAY = 0.1


def synthetic_batch(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> dict:
    """One unpacked document per row: the ``[batch, seq_len]`` dict ``make_train_step`` takes."""
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((batch, seq_len), np.int32),
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy(),
            "loss_mask": np.ones((batch, seq_len), np.float32)}


class K3jaxStep:
    """The train.py step over a split TrainState; ``__call__`` runs one step (state donated)."""

    def __init__(self, cfg, model, batch):
        with nnx.use_eager_sharding(False):
            ts = TrainState(model, make_optimizer(cfg.train.optim, model, cfg.train.steps))
        graphdef, self.state = nnx.split(ts)
        self.batch = jax.device_put(batch)
        step = make_train_step(graphdef, cfg)
        log("    compiling (lower + compile)")
        t0 = time.perf_counter()
        self.compiled = step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.loss = float("nan")

    def __call__(self):
        self.state, metrics = self.compiled(self.state, self.batch)
        return metrics

    def block(self, metrics):
        self.loss = float(metrics["loss"])  # waits for the step


class HFStep:
    def __init__(self, model, batch):
        self.model = model.train()
        self.ids = torch.as_tensor(batch["tokens"], dtype=torch.long)
        self.opt = torch.optim.AdamW(model.parameters(), lr=HF_LEARNING_RATE, weight_decay=HF_WEIGHT_DECAY)
        self.compile_s = 0.0
        self.loss = float("nan")

    def __call__(self):
        out = self.model(input_ids=self.ids, labels=self.ids, use_cache=False)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out.loss

    def block(self, loss):
        self.loss = float(loss.detach())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny config and sizes, one repeat")
    ap.add_argument("--config", default=None, help="k3jax config (default: small; tiny with --quick)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default 4; 2 with --quick)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 256; 32 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps, median taken (default 3; 1 quick)")
    ap.add_argument("--no-same-weights", action="store_true",
                    help="skip k3jax's step on the HF model's architecture and weights (saves a compile)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    name = args.config or ("tiny" if q else "small")
    batch_size, seq_len = args.batch_size or (2 if q else 4), args.seq_len or (32 if q else 256)
    repeats = args.repeats or (1 if q else 3)
    if q:
        # A smoke run checks that the bench works; XLA:CPU's optimisation passes would dominate it.
        jax.config.update("jax_disable_most_optimizations", True)
    import transformers
    from transformers import KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)

    cfg = load_config(name, [f"train.batch_size={batch_size}", f"train.seq_len={seq_len}"])
    batch = synthetic_batch(np.random.default_rng(args.seed), batch_size, seq_len, cfg.model.vocab_size)
    hf_model = KimiLinearForCausalLM(hf_kimi_linear_config(cfg.model))
    randomize_torch(hf_model, args.seed)

    steps = {}
    log(f"train-step bench: k3jax {name!r} vs HF KimiLinearForCausalLM, {batch_size} x {seq_len} tokens/step")
    log(f"  k3jax_{name}")
    steps[f"k3jax_{name}"] = K3jaxStep(cfg, create_model(cfg.model, seed=args.seed), batch)
    if not args.no_same_weights:
        log("  k3jax_kimi_linear (the HF model's weights)")
        with tempfile.TemporaryDirectory() as tmp:
            hf_model.save_pretrained(tmp)
            kl = from_hf(tmp)
        steps["k3jax_kimi_linear"] = K3jaxStep(dataclasses.replace(cfg, model=kl.cfg), kl, batch)
    steps["hf_kimi_linear"] = HFStep(hf_model, batch)

    for key, s in steps.items():
        log(f"  warm-up step: {key}")
        s.first_s = timed(s, s.block)
    times = {key: [] for key in steps}
    for r in range(repeats):
        log(f"  repeat {r + 1}/{repeats}")
        for key, s in steps.items():
            times[key].append(timed(s, s.block))

    tokens = batch_size * seq_len
    results = {key: {"tokens_per_s": round(tokens / median(ts), 2), "step_s": round(median(ts), 3),
                     "best_of_repeats_tokens_per_s": round(tokens / min(ts), 2),
                     "step_s_all": [round(t, 3) for t in ts], "compile_s": round(steps[key].compile_s, 1),
                     "first_step_s": round(steps[key].first_s, 2), "last_loss": round(steps[key].loss, 4)}
               for key, ts in times.items()}
    k3_params = count_params(cfg.model)
    hf_params = torch_param_counts(hf_model)
    report = {
        "bench": "train_step", "quick": q, "xla_optimizations": not q, **cpu_info(),
        "settings": {"config": name, "batch_size": batch_size, "seq_len": seq_len, "tokens_per_step": tokens,
                     "repeats": repeats, "dtype": "float32",
                     "k3jax_optimizer": "per-head Muon + AdamW (config), Quantile Balancing",
                     "hf_optimizer": f"torch AdamW lr={HF_LEARNING_RATE} wd={HF_WEIGHT_DECAY}"},
        "params": {f"k3jax_{name}": {"total": k3_params["total"], "active": k3_params["active"]},
                   "hf_kimi_linear": hf_params,
                   "matching": "same widths/depth/layout/heads/experts/top-k; routed and shared expert "
                               "parameters and FLOPs per token equal; the rest of the difference is K3-only "
                               "structure (latent MoE projections, MLA output gate, full-rank KDA output "
                               "gate, AttnRes)"},
        "results": results,
        "ratios": {},
    }
    pairs = {f"k3jax_{name} / hf_kimi_linear (matched size)": f"k3jax_{name}",
             "k3jax_kimi_linear / hf_kimi_linear (identical weights)": "k3jax_kimi_linear"}
    for label, key in pairs.items():
        if key in results:
            report["ratios"][label] = {
                "median": round(results[key]["tokens_per_s"] / results["hf_kimi_linear"]["tokens_per_s"], 3),
                "best": round(results[key]["best_of_repeats_tokens_per_s"]
                              / results["hf_kimi_linear"]["best_of_repeats_tokens_per_s"], 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
