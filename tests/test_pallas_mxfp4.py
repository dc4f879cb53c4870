"""The MXFP4 grouped matmul (``pallas_kernels/moe/gmm_mxfp4.py``, interpret mode on CPU) against the codec
of ``k3jax.quant.mxfp4`` and a plain per-group matmul of its dequantized weights; its input gradient; the
Pallas expert GLU with MXFP4 weights against the same GLU on the dequantized weights. The TPU lowering is
compiled in tests/test_pallas_tpu_aot.py.

Tolerances as in tests/test_pallas_moe.py: the decoded weights are exact (E2M1 times a power of two), so
only the summation order differs (fp32: 1e-5 of the largest output; the kernel adds the even and odd
columns as two products), and bf16 inputs give one bf16 rounding of the result (2^-8 relative RMS).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.quant.mxfp4 import dequantize_mxfp4
from pallas_kernels.moe import MXFP4, gmm_mxfp4, grouped_glu_experts, mxfp4_grouped_matmul
from pallas_kernels.moe.gmm_mxfp4 import gmm_mxfp4_reference
from pallas_kernels.mxfp4 import dequantize
from test_pallas_moe import max_rel, rms_rel

pytestmark = pytest.mark.usefixtures("fast_xla")
# empty groups first, in the middle, consecutive and last; a group inside one tile; groups straddling
# 16-row tiles; 3 rows past sum(group_sizes)
GROUPS = [0, 5, 0, 0, 30, 2, 0, 11, 0]
M = sum(GROUPS) + 3
TILING = (16, 256, 128)  # 16-row tiles; 128-lane nibble planes: 2 contraction steps at in = 512


def random_mxfp4(seed, e, n_out, n_in, scales=(118, 134)):
    """Random bytes (every E2M1 code in both nibbles, signs and -0 included, at these sizes); scale bytes
    drawn from ``[lo, hi)``: 2^-9 .. 2^6 by default."""
    kp, ks = jax.random.split(jax.random.PRNGKey(seed))
    packed = jax.random.randint(kp, (e, n_out, n_in // 2), 0, 256).astype(jnp.uint8)
    scale = jax.random.randint(ks, (e, n_out, n_in // 32), *scales).astype(jnp.uint8)
    return MXFP4(packed, scale)


def codec(w: MXFP4, dtype=jnp.float32):
    """The weight ``[E, in, out]`` as k3jax's codec decodes it (the reference)."""
    return jnp.swapaxes(dequantize_mxfp4(w.packed, w.scale, dtype), 1, 2)


def per_group(x, w_dense, groups):
    """The plain reference: each group's rows times its expert's weight (float64); other rows zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w_dense, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    off = np.concatenate([[0], np.cumsum(groups)])
    for g in range(len(groups)):
        out[off[g]:off[g + 1]] = x[off[g]:off[g + 1]] @ w[g]
    return out


def test_decode_matches_the_codec_bit_for_bit():
    """Every byte of codes with every normal scale byte, and the NaN scale (0xFF)."""
    codes = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (254, 1))[None]  # [1, 254, 256]: 512 inputs per row
    scale = jnp.broadcast_to(jnp.arange(2, 256, dtype=jnp.uint8)[None, :, None], (1, 254, 16))
    w = MXFP4(codes, scale)
    got, want = np.asarray(dequantize(w)), np.asarray(dequantize_mxfp4(codes, scale))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(np.isnan(got[0, -1]))  # 0xFF: the whole block is NaN
    assert np.array_equal(np.asarray(dequantize(w, jnp.bfloat16)), np.asarray(dequantize_mxfp4(codes, scale,
                                                                                                jnp.bfloat16)),
                          equal_nan=True)


def test_gmm_mxfp4_fp32_matches_the_dequantized_weights():
    E, D, F = len(GROUPS), 512, 256  # 2 contraction steps, 2 column tiles
    w = random_mxfp4(0, E, F, D)
    # NaN scales in an expert without rows: never read (the grid skips empty groups)
    w = MXFP4(w.packed, w.scale.at[2].set(0xFF))
    x = jax.random.normal(jax.random.PRNGKey(1), (M, D))
    gs = jnp.array(GROUPS, jnp.int32)
    y = gmm_mxfp4(x, w, gs, tiling=TILING)
    assert y.shape == (M, F) and y.dtype == jnp.float32
    want = per_group(x, codec(w), GROUPS)
    assert np.all(np.isfinite(np.asarray(y)))
    assert max_rel(y, want) < 1e-5
    assert np.all(np.asarray(y[sum(GROUPS):]) == 0)  # rows past the groups are zero


@pytest.mark.parametrize("D,F", [(64, 48), (640, 384), (32, 32)], ids=["small", "unaligned", "one-block"])
def test_gmm_mxfp4_bf16_odd_widths(D, F):
    """bf16 inputs; widths whose nibble planes are whole (not lane tiles) or a single 32-block."""
    E = len(GROUPS)
    w = random_mxfp4(2, E, F, D, scales=(100, 150))
    x = jax.random.normal(jax.random.PRNGKey(3), (M, D)).astype(jnp.bfloat16)
    y = gmm_mxfp4(x, w, jnp.array(GROUPS, jnp.int32), tiling=TILING)
    assert y.dtype == jnp.bfloat16
    want = per_group(x.astype(jnp.float32), codec(w), GROUPS)
    assert rms_rel(y, want) < 2.0**-8
    assert max_rel(gmm_mxfp4_reference(x, w, jnp.array(GROUPS, jnp.int32)), want) < 2.0**-7  # the plain one too


def test_input_gradient_matches_the_dequantized_weights():
    E, D, F = len(GROUPS), 256, 128
    w = random_mxfp4(4, E, F, D)
    x = jax.random.normal(jax.random.PRNGKey(5), (M, D))
    c = jax.random.normal(jax.random.PRNGKey(6), (M, F))
    gs = jnp.array(GROUPS, jnp.int32)
    dense = codec(w)
    got = jax.grad(lambda x: jnp.sum(mxfp4_grouped_matmul(x, w, gs, tiling=TILING) * c))(x)
    want = jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(x, dense, gs, precision=jax.lax.Precision.HIGHEST) * c))(x)
    assert got.shape == x.shape and max_rel(got, want) < 1e-5


def test_glu_with_mxfp4_weights_matches_the_dequantized_glu():
    """The Pallas expert GLU with the three weights as MXFP4: forward and the input's gradient equal the GLU
    on the dequantized weights (bf16, as the model runs it)."""
    N, k, E, L, F = 12, 3, 6, 64, 96
    x = jax.random.normal(jax.random.PRNGKey(7), (N, L)).astype(jnp.bfloat16)
    experts = jax.random.randint(jax.random.PRNGKey(8), (N, k), 0, E - 2)  # the last two experts stay empty
    ws = (random_mxfp4(9, E, F, L), random_mxfp4(10, E, F, L), random_mxfp4(11, E, L, F))  # gate, up: L -> F
    dense = tuple(codec(w, jnp.bfloat16) for w in ws)
    c = jax.random.normal(jax.random.PRNGKey(12), (N, k, L))

    def glu(*w):
        return lambda x: grouped_glu_experts(x, experts, *w, activation="situ_glu")

    def loss(*w):
        return lambda x: jnp.sum(glu(*w)(x).astype(jnp.float32) * c)

    @jax.jit
    def run(x):
        return glu(*ws)(x), jax.grad(loss(*ws))(x), glu(*dense)(x), jax.grad(loss(*dense))(x)

    out, dx, out_ref, dx_ref = run(x)
    assert out.shape == (N, k, L) and out.dtype == jnp.bfloat16
    assert rms_rel(out, out_ref) < 3 * 2.0**-8
    assert dx.dtype == jnp.bfloat16 and rms_rel(dx, dx_ref) < 3 * 2.0**-8


def test_packed_model_decodes_its_experts_in_the_kernel():
    """A tiny model with packed MXFP4 experts and ``moe_impl: pallas`` hands the bytes to the kernel (no
    whole-weight dequantization in the program) and computes what the dequantizing path computes: logits,
    and the gradients of the trained parameters through the frozen experts (the kernel's dx)."""
    from flax import nnx

    from k3jax.config import load_config
    from k3jax.model import create_model

    overrides = ["model.num_layers=2", "quant.experts=mxfp4"]  # KDA + dense FFN, MLA + latent MoE
    tokens = jax.random.randint(jax.random.PRNGKey(13), (2, 16), 0, 256)

    def run(impl):
        model = create_model(load_config("tiny", overrides + [f"model.moe_impl={impl}"]).model, seed=0)

        def loss(model):
            return jnp.sum(jnp.sin(model(tokens)[0]))

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        fn = jax.jit(lambda p: jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, rest)))(p))
        return fn(params), str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p, rest)(tokens)[0])(params))

    (got, grads), jaxpr = run("pallas")
    (want, want_grads), ref_jaxpr = run("ragged_dot")
    assert "gmm_mxfp4" in jaxpr and "gmm_mxfp4" not in ref_jaxpr
    dense = "f32[8,32,32]"  # a layer's experts dequantized (E, L, F), tiny's widths
    assert dense in ref_jaxpr and dense not in jaxpr
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    errs = jax.tree.map(max_rel, grads, want_grads)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
