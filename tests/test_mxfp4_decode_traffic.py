"""A decode step with MXFP4 routed experts reads their packed bytes, not dequantized copies: the expert matmuls
take the codes and scales (``pallas_kernels/moe/gmm_mxfp4.py``) and the step's routed-expert HBM traffic stays
near the 17/32 byte a parameter is stored in. Before, every local expert was dequantized whole each step,
its int32 intermediates materialised by XLA:TPU: 97 bytes per parameter at these widths (11 GB per device
and step against 0.066 GB now).

Compiled for a v5p slice with libtpu (no TPU needed): ``tiny`` with wider experts (L = 1024, F = 1536), 16
experts over ``expert=8``.
"""

import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu")

from k3jax import aot  # noqa: E402
from k3jax.config import MeshConfig, load_config  # noqa: E402
from test_decode_memory import compile_decode  # noqa: E402

pytestmark = pytest.mark.tpu_aot

SLICE, MESH = "v5p-16", MeshConfig(expert=8)
OVERRIDES = ("model.kda.num_heads=8", "model.mla.num_heads=8", "model.moe.num_experts=16",
             "model.moe.expert_dim=1536", "model.moe.latent_dim=1024", "model.param_dtype=bfloat16",
             "model.dtype=bfloat16", "quant.experts=mxfp4")


def test_decode_reads_the_packed_experts():
    r = compile_decode(aot.Job("tiny", "decode", SLICE, MESH, batch=8, seq_len=2048, overrides=OVERRIDES))
    cfg = load_config("tiny", list(OVERRIDES)).model
    moe_layers = cfg.num_layers - cfg.first_dense_layers
    local_params = moe_layers * cfg.moe.num_experts // MESH.expert * 3 * cfg.moe.latent_dim * cfg.moe.expert_dim
    # the step as it usually runs: one exchange round (the overflow rounds run only past 1.25x a fair load)
    b = r.breakdown_no_overflow or r.breakdown
    routed = sum(v for (part, _), v in b.hbm_bytes.items() if part == "routed_experts")
    stored = local_params * 17 / 32  # 4-bit codes and an 8-bit scale per 32
    print(f"routed experts: {routed / 1e9:.4f} GB per device and step, {routed / local_params:.2f} bytes per parameter")
    assert stored < routed < 1.25 * stored, (routed, stored)
