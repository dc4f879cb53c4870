"""Parameter counts: the CLI's figures for K3 and K2, and a real model's leaves for tiny."""

import json
import math
import pathlib
import subprocess
import sys
import time

import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.params import count_params

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cli(*args):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "k3jax.params", *args], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def test_k3_cli_matches_report():
    counts, seconds = _cli("k3")
    assert counts["total"] == pytest.approx(2.78e12, rel=3e-3)
    assert counts["active"] == pytest.approx(104.2e9, rel=3e-3)
    assert counts["active_with_embedding"] - counts["active"] == counts["embedding"] == 163840 * 7168
    # abstract: nothing allocated, so it is quick even for 2.78T parameters (measured ~4 s on 2 shared cores)
    assert seconds < 60, f"python -m k3jax.params k3 took {seconds:.1f} s"


def test_k2_matches_report():
    counts = count_params(load_config("k2").model)
    assert counts["total"] == pytest.approx(1.04e12, rel=2e-2)
    # the K2 report counts the input embedding as active
    assert counts["active_with_embedding"] == pytest.approx(32.6e9, rel=3e-2)


def test_cli_accepts_overrides(capsys):
    from k3jax.params import main

    main(["tiny"])
    base = json.loads(capsys.readouterr().out)
    main(["tiny", "model.moe.num_experts=16"])
    more = json.loads(capsys.readouterr().out)
    # 8 more experts in each of the 12 MoE layers; each expert has 3 matrices of 32 x 32
    assert more["total"] - base["total"] == 12 * 8 * 3 * 32 * 32 + 12 * 64 * 8  # + the router columns
    assert more["active"] - base["active"] == 12 * 64 * 8  # top_k unchanged: only the router grows


def _real_counts(model, cfg):
    """Counts from a real model's nnx.Param leaves, routed experts found by *path* (not axis names)."""
    total = routed = embed = 0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        n = math.prod(var.get_raw_value().shape)
        total += n
        owner = model
        for p in path[:-1]:
            owner = owner[p] if isinstance(p, int) else getattr(owner, p)
        if type(owner).__name__ == "LatentMoE" and path[-1] in ("w_gate", "w_up", "w_down"):
            routed += n
        if tuple(path) == ("embed",):
            embed = n
    active = total - routed + routed * cfg.moe.top_k / cfg.moe.num_experts - embed
    return total, active, routed, embed


@pytest.mark.parametrize("overrides", [[], ["model.scan_layers=false", "model.tie_embeddings=true"]])
def test_tiny_count_equals_real_model(overrides):
    from k3jax.model import create_model

    cfg = load_config("tiny", overrides).model
    model = create_model(cfg)
    total, active, routed, embed = _real_counts(model, cfg)
    counts = count_params(cfg)
    assert counts["total"] == total
    assert counts["routed_experts"] == routed > 0
    if cfg.tie_embeddings:
        assert counts["active"] == pytest.approx(active + embed)  # the tied table is the lm_head: a matmul
    else:
        assert counts["embedding"] == embed == cfg.vocab_size * cfg.hidden_size
        assert counts["active"] == pytest.approx(active)
    # routed experts of tiny: 12 MoE layers x 8 experts x (2 x 32x32 + 32x32)
    assert routed == 12 * 8 * 3 * 32 * 32
