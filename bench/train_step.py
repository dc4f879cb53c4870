"""Training-step throughput on CPU, k3jax against HF transformers; prints one JSON document.

    python bench/train_step.py           # `small` config, 4 x 256 tokens per step (~10 min on 2 busy cores)
    python bench/train_step.py --quick   # smoke run: `tiny`, 2 x 32 tokens, XLA optimisations off

Timed in the same process, interleaved step by step (so that load from other processes hits all
of them alike), after ``--warmup`` interleaved warm-up rounds (3: the first steps of the Muon step
still grow the process's heap, 2-5 s against a steady 2.4-2.7 s); the k3jax compile is timed on its
own (``lower().compile()``).
Medians over ``--repeats``, and the best repeat (least disturbed by other load; ``load_average``
says how busy the machine was). Both sides run with glibc keeping freed memory (``common`` sets
``K3JAX_HOST_MEMORY=keep``, ``k3jax/runtime/host_memory.py``; ``host_memory_kept`` in the report): with glibc's defaults
both page-faulted their temporaries in on every step, torch's more (HF 6.7 s per step, k3jax 3.3 s).

- ``k3jax_<config>``: the step ``train.py`` runs (``k3jax.training.step.make_train_step``: forward,
  backward, per-head Muon + AdamW, Quantile Balancing, NaN guard) on the config itself;
- ``k3jax_<config>_adamw`` (unless ``--no-adamw``): the same step with ``train.optim.optimizer=adamw``
  (AdamW for every parameter, as HF's side): the ratio with the optimizers matched;
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

``achieved`` is each step's useful work per second, ``model_flops_per_step`` / median step time, against
a float32 matmul peak measured in the same process (``matmul_peak``: the best of several jitted
square matmuls): ``6 * N_active * tokens`` (forward + backward through every active weight) plus the
token mixing that is not a weight matmul, forward + backward (3x): causal softmax attention in the MLA
layers and KDA's chunkwise algorithm, ``k3jax.aot.analytic.mixing_flops_per_token`` (its docstring derives
them). The optimizer's FLOPs (Muon's Newton-Schulz iterations) are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
import time

# common first: it pins JAX to the CPU before jax is imported
from common import (cpu_info, hf_kimi_linear_config, log, matmul_peak, median, randomize_torch, timed,
                    torch_param_counts)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.aot import analytic  # noqa: E402
from k3jax.config import load_config  # noqa: E402
from k3jax.interop import from_hf  # noqa: E402
from k3jax.model import create_model  # noqa: E402
from k3jax.optim import make_optimizer  # noqa: E402
from k3jax.params import count_params  # noqa: E402
from k3jax.training.step import TrainState, make_train_step  # noqa: E402

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


def model_flops_per_step(cfg, active_params: int, batch: int, seq_len: int) -> float:
    """``6 * N_active * tokens`` + 3 x the forward mixing FLOPs (``k3jax.aot.analytic``) of the k3jax
    ``ModelConfig`` ``cfg``'s layout."""
    tokens = batch * seq_len
    mixing = sum(analytic.mixing_flops_per_token(cfg, seq_len).values())
    return 6.0 * active_params * tokens + 3.0 * mixing * tokens


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
    """The HF model's training step: forward with labels, ``backward()``, ``AdamW.step()``; on ``device``,
    under ``torch.autocast`` to ``autocast`` (a torch dtype) when given (bench/gpu.py: bf16 on the GPU)."""

    def __init__(self, model, batch, device="cpu", autocast=None):
        self.model = model.train()
        self.ids = torch.as_tensor(batch["tokens"], dtype=torch.long, device=device)
        self.opt = torch.optim.AdamW(model.parameters(), lr=HF_LEARNING_RATE, weight_decay=HF_WEIGHT_DECAY)
        self.context = (lambda: torch.autocast(device, dtype=autocast)) if autocast else contextlib.nullcontext
        self.compile_s = 0.0
        self.loss = float("nan")

    def __call__(self):
        with self.context():
            out = self.model(input_ids=self.ids, labels=self.ids, use_cache=False)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out.loss

    def block(self, loss):
        self.loss = float(loss.detach())  # waits for the step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny config and sizes, one repeat")
    ap.add_argument("--config", default=None, help="k3jax config (default: small; tiny with --quick)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default 4; 2 with --quick)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 256; 32 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps, median taken (default 3; 1 quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds of steps first (default 3; 1 quick)")
    ap.add_argument("--no-same-weights", action="store_true",
                    help="skip k3jax's step on the HF model's architecture and weights (saves a compile)")
    ap.add_argument("--no-adamw", action="store_true",
                    help="skip k3jax's step with AdamW for every parameter (saves a compile)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    name = args.config or ("tiny" if q else "small")
    batch_size, seq_len = args.batch_size or (2 if q else 4), args.seq_len or (32 if q else 256)
    repeats = args.repeats or (1 if q else 3)
    warmup = args.warmup or (1 if q else 3)
    if q:
        # A smoke run checks that the bench works; XLA:CPU's optimisation passes would dominate it.
        jax.config.update("jax_disable_most_optimizations", True)
    import transformers
    from transformers import KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)

    shape = [f"train.batch_size={batch_size}", f"train.seq_len={seq_len}"]
    cfg = load_config(name, shape)
    batch = synthetic_batch(np.random.default_rng(args.seed), batch_size, seq_len, cfg.model.vocab_size)
    hf_model = KimiLinearForCausalLM(hf_kimi_linear_config(cfg.model))
    randomize_torch(hf_model, args.seed)

    log("matmul peak")
    peak = matmul_peak()
    steps = {}
    log(f"train-step bench: k3jax {name!r} vs HF KimiLinearForCausalLM, {batch_size} x {seq_len} tokens/step")
    log(f"  k3jax_{name}")
    steps[f"k3jax_{name}"] = K3jaxStep(cfg, create_model(cfg.model, seed=args.seed), batch)
    if not args.no_adamw:
        log(f"  k3jax_{name}_adamw (AdamW for every parameter, as HF's side)")
        adamw = load_config(name, [*shape, "train.optim.optimizer=adamw"])
        steps[f"k3jax_{name}_adamw"] = K3jaxStep(adamw, create_model(adamw.model, seed=args.seed), batch)
    if not args.no_same_weights:
        log("  k3jax_kimi_linear (the HF model's weights)")
        with tempfile.TemporaryDirectory() as tmp:
            hf_model.save_pretrained(tmp)
            kl = from_hf(tmp)
        steps["k3jax_kimi_linear"] = K3jaxStep(dataclasses.replace(cfg, model=kl.cfg), kl, batch)
    steps["hf_kimi_linear"] = HFStep(hf_model, batch)

    for w in range(warmup):
        log(f"  warm-up round {w + 1}/{warmup}")
        for key, s in steps.items():
            t = timed(s, s.block)
            if w == 0:
                s.first_s = t
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
    flops = {f"k3jax_{name}": model_flops_per_step(cfg.model, k3_params["active"], batch_size, seq_len),
             "hf_kimi_linear": model_flops_per_step(cfg.model, hf_params["active"], batch_size, seq_len)}
    if "k3jax_kimi_linear" in results:
        flops["k3jax_kimi_linear"] = flops["hf_kimi_linear"]
    if f"k3jax_{name}_adamw" in results:
        flops[f"k3jax_{name}_adamw"] = flops[f"k3jax_{name}"]
    peak["gflop_per_s_at_end"] = matmul_peak()["gflop_per_s"]  # load may change during the run
    for key, res in results.items():
        gflops = flops[key] / res["step_s"] / 1e9
        res["model_flops_per_step"] = flops[key]
        res["achieved_gflop_per_s"] = round(gflops, 2)
        res["fraction_of_matmul_peak"] = round(gflops / max(peak["gflop_per_s"], peak["gflop_per_s_at_end"]), 3)
    report = {
        "bench": "train_step", "quick": q, "xla_optimizations": not q, **cpu_info(),
        "settings": {"config": name, "batch_size": batch_size, "seq_len": seq_len, "tokens_per_step": tokens,
                     "repeats": repeats, "warmup_rounds": warmup, "dtype": "float32",
                     "k3jax_optimizer": "per-head Muon + AdamW (config), Quantile Balancing",
                     "hf_optimizer": f"torch AdamW lr={HF_LEARNING_RATE} wd={HF_WEIGHT_DECAY}"},
        "params": {f"k3jax_{name}": {"total": k3_params["total"], "active": k3_params["active"]},
                   "hf_kimi_linear": hf_params,
                   "matching": "same widths/depth/layout/heads/experts/top-k; routed and shared expert "
                               "parameters and FLOPs per token equal; the rest of the difference is K3-only "
                               "structure (latent MoE projections, MLA output gate, full-rank KDA output "
                               "gate, AttnRes)"},
        "matmul_peak": peak,
        "results": results,
        "ratios": {},
    }
    pairs = {f"k3jax_{name} / hf_kimi_linear (matched size)": f"k3jax_{name}",
             f"k3jax_{name}_adamw / hf_kimi_linear (matched size, both AdamW)": f"k3jax_{name}_adamw",
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
