"""The CPU benchmarks stay runnable: the size matching of their HF Kimi Linear model (always), and
``bench/decode.py`` / ``bench/train_step.py`` end to end in ``--quick`` mode (tiny config; one batch
size, no second k3jax train step) when ``K3JAX_BENCH_TESTS=1``: those two take about 1.5 and 1.2 min
of CPU time (mostly XLA compiles of the tiny model's generate and train step), several minutes of
wall time on a busy 2-core machine, too much for every test run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TIMEOUT_S = 900
run_benches = pytest.mark.skipif(os.environ.get("K3JAX_BENCH_TESTS") != "1",
                                 reason="end-to-end bench runs: set K3JAX_BENCH_TESTS=1")


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@run_benches
def test_decode_bench_quick():
    r = _run("decode.py", "--batch-sizes", "1")
    assert r["parity_k3jax_vs_hf_same_weights"]["max_rel_logit_diff"] < 1e-4
    for name in ("k3jax_tiny", "k3jax_kimi_linear", "hf_kimi_linear"):
        res = r["results"]["batch_1"][name]
        assert res["prefill_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert set(r["ratios"]) == {"k3jax_kimi_linear / hf_kimi_linear (identical weights)",
                                "k3jax_tiny / hf_kimi_linear (matched size)"}
    # the roofline at both bandwidths: the same bytes over each measured rate
    roof, matvec = r["roofline"]["batch_1"]["k3jax_tiny"], r["matvec_bandwidth"]
    assert matvec["size"] == 64 and matvec["gb_per_s"] > 0  # tiny's hidden size
    nbytes = roof["bytes"]["weights"] + roof["bytes"]["cache"]
    for floor, rate in ((roof, r["memory_bandwidth"]), (roof["at_matvec_bandwidth"], matvec)):
        assert floor["floor_step_ms"] == pytest.approx(nbytes / (rate["gb_per_s"] * 1e9) * 1e3, rel=1e-3)
    cache = r["cache"]
    # K3: 24 MLA layers x (512 latent + 64 rope) bf16 values per token + the 1-byte valid flag
    assert cache["bytes_per_token"] == 24 * 576 * 2 + 1
    per_seq = cache["bytes_per_token"] * cache["context"] + cache["bytes_fixed_per_sequence"]
    assert cache["bytes_per_sequence"] == per_seq


@pytest.mark.slow
@run_benches
def test_train_step_bench_quick():
    r = _run("train_step.py", "--no-same-weights")
    for name in ("k3jax_tiny", "k3jax_tiny_adamw", "hf_kimi_linear"):
        res = r["results"][name]
        assert res["tokens_per_s"] > 0 and np.isfinite(res["last_loss"])
    assert r["ratios"]["k3jax_tiny / hf_kimi_linear (matched size)"]["median"] > 0
    assert r["ratios"]["k3jax_tiny_adamw / hf_kimi_linear (matched size, both AdamW)"]["median"] > 0


@pytest.mark.parametrize("config", ["tiny", "small"])
def test_hf_matched_config(config):
    """The HF model has k3jax's layout and exactly its routed-expert parameters (the latent expert's
    parameters moved into a narrower full-width expert)."""
    sys.path.insert(0, str(BENCH))
    try:
        from common import hf_kimi_linear_config, torch_param_counts
    finally:
        sys.path.remove(str(BENCH))
    from transformers import KimiLinearForCausalLM

    from k3jax.config import load_config
    from k3jax.params import count_params

    cfg = load_config(config).model
    hf_cfg = hf_kimi_linear_config(cfg)
    assert [t == "full_attention" for t in hf_cfg.layer_types] == [cfg.mixer(i) == "mla" for i in range(cfg.num_layers)]
    model = KimiLinearForCausalLM(hf_cfg)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    ours = count_params(cfg)
    assert routed == ours["routed_experts"]
    counts = torch_param_counts(model)
    assert 0.8 < counts["total"] / ours["total"] <= 1.0  # the rest: K3-only latent projections, gates, AttnRes


@pytest.mark.slow
@run_benches
def test_gpu_bench_quick_on_cpu():
    """bench/gpu.py's correctness section, kernels in interpret mode: every case ran and agrees."""
    r = _run("gpu.py", "--sections", "check,moe")
    check = r["check"]
    assert not any("error" in v for v in check.values() if isinstance(v, dict)), check
    for key, v in check.items():
        worst = max(v.values()) if isinstance(v, dict) else v
        assert worst < (2e-2 if "bfloat16" in key else 1e-5), (key, v)
    assert all("speedup_pallas_vs_ragged_dot" in r["moe"][k] for k in ("gmm", "gmm_transposed", "tgmm"))
