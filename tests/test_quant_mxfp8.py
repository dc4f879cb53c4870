"""The JAX MXFP8 (E4M3) activation quantizer against a NumPy transcription built on ml_dtypes'
float8_e4m3fn conversion (IEEE round to nearest even, exact subnormals), bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.quant import straight_through
from k3jax.quant.formats import E4M3, E8M0_BIAS, E8M0_NAN, GROUP_SIZE, SCALE_RULES
from k3jax.quant.mxfp8 import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8

from test_quant_mxfp4 import adversarial_blocks, assert_same_floats, random_blocks  # noqa: E402

# op-by-op and jitted programs compiled without XLA's optimisation passes (values are compared)
pytestmark = pytest.mark.usefixtures("fast_xla")

E4M3_MAX_MANTISSA = E4M3.max_value / 2.0**E4M3.emax  # 448 = 1.75 * 2**8


def np_shared_exponent(amax: np.ndarray, rule: str) -> np.ndarray:
    """OCP Algorithm 1 and the no-clip variants for E4M3 (emax 8, largest 448), with frexp."""
    m, e = np.frexp(np.where(amax > 0, amax, 1.0).astype(np.float32))
    mantissa, fl = 2.0 * m, e.astype(np.int64) - 1
    exp = fl - E4M3.emax
    if rule == "ceil":
        exp = exp + (mantissa > E4M3_MAX_MANTISSA)
    elif rule == "aiter":
        exp = exp + (mantissa >= 1.5)
    return np.clip(np.where(amax > 0, exp, 0), -127, 127)


def np_mxfp8(x: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """``x [..., n]`` -> (float8_e4m3fn elements, uint8 scales), blocks along the last axis."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, GROUP_SIZE)
    amax = np.abs(blocks).max(-1)
    finite = np.isfinite(amax)
    exp = np_shared_exponent(np.where(finite, amax, 0), rule)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = blocks * np.ldexp(np.float32(1), -exp)[..., None].astype(np.float32)  # exact: a power of two
    scaled = np.clip(np.where(finite[..., None], scaled, 0), -E4M3.max_value, E4M3.max_value)
    elements = scaled.astype(ml_dtypes.float8_e4m3fn).reshape(x.shape)
    return elements, np.where(finite, exp + E8M0_BIAS, E8M0_NAN).astype(np.uint8)


def np_dequantize(elements: np.ndarray, scales: np.ndarray) -> np.ndarray:
    values = elements.astype(np.float32).reshape(*elements.shape[:-1], -1, GROUP_SIZE)
    with np.errstate(over="ignore", invalid="ignore"):
        out = values * np.ldexp(np.float32(1), scales.astype(np.int32) - E8M0_BIAS)[..., None].astype(np.float32)
    out = np.where((scales == E8M0_NAN)[..., None], np.float32(np.nan), out)
    return out.reshape(elements.shape)


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("data", ["random", "adversarial"])
def test_jax_matches_numpy_transcription(rule, data):
    x = random_blocks(10) if data == "random" else adversarial_blocks()
    elements, scales = quantize_mxfp8(jnp.asarray(x), rule=rule)
    ref_elements, ref_scales = np_mxfp8(x, rule)
    np.testing.assert_array_equal(np.asarray(scales), ref_scales)
    got_codes = np.asarray(elements).view(np.uint8)
    want_codes = ref_elements.view(np.uint8)
    finite_block = np.repeat(ref_scales != E8M0_NAN, GROUP_SIZE, axis=-1)
    np.testing.assert_array_equal(got_codes[finite_block], want_codes[finite_block])
    assert (got_codes[~finite_block] == 0).all()
    decoded = np_dequantize(ref_elements, ref_scales)
    assert_same_floats(dequantize_mxfp8(elements, scales, jnp.float32), decoded)
    assert_same_floats(fake_quantize_mxfp8(jnp.asarray(x), rule=rule), decoded)


def test_every_code_decodes_as_the_spec():
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    elements = codes.view(ml_dtypes.float8_e4m3fn)
    for c in range(256):
        assert (np.isnan(E4M3.value(c)) and np.isnan(float(elements.reshape(-1)[c]))) or \
            E4M3.value(c) == float(elements.reshape(-1)[c]), c
    scales = np.full((8, 1), 127, np.uint8)
    assert_same_floats(dequantize_mxfp8(jnp.asarray(elements), jnp.asarray(scales)), elements.astype(np.float32))


@pytest.mark.parametrize("rule", ["ceil", "aiter"])
def test_error_bound_and_grid_exactness(rule):
    """Normal elements: relative error at most 2**-4 (half an ulp with 3 mantissa bits); no clipping;
    values on the grid are exact."""
    x = random_blocks(11)
    x = x[np.isfinite(x).all(-1)]
    elements, scales = quantize_mxfp8(jnp.asarray(x), rule=rule)
    q = np.asarray(dequantize_mxfp8(elements, scales), np.float64)
    x_scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - E8M0_BIAS), GROUP_SIZE, axis=-1)
    y = np.abs(x.astype(np.float64)) / x_scale
    assert (y <= E4M3.max_value).all()
    normal = y >= 2.0**E4M3.emin
    rel = np.abs(q - x)[normal] / np.abs(x.astype(np.float64))[normal]
    assert rel.max() <= 2.0**-4
    np.testing.assert_array_equal(np.asarray(fake_quantize_mxfp8(jnp.asarray(q.astype(np.float32)), rule=rule)),
                                  q.astype(np.float32))


def test_bfloat16_activations_along_an_axis():
    x = random_blocks(12, rows=64, cols=96)[:, :96]
    x16 = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    got = fake_quantize_mxfp8(x16.reshape(2, 32, 96), axis=1)
    assert got.dtype == jnp.bfloat16
    want = np_dequantize(*np_mxfp8(np.swapaxes(np.asarray(x16, np.float32).reshape(2, 32, 96), 1, 2), "ceil"))
    assert_same_floats(np.asarray(got, np.float32), np.swapaxes(want, 1, 2))


def test_straight_through_activation_gradient():
    x = jnp.asarray(np.random.default_rng(13).standard_normal((4, 64)), jnp.float32)
    fq = straight_through(fake_quantize_mxfp8)
    g = jax.grad(lambda v: jnp.sum(jnp.sin(fq(v))))(x)
    np.testing.assert_allclose(np.asarray(g), np.cos(np.asarray(fake_quantize_mxfp8(x))), rtol=1e-6)
    assert float(jnp.abs(jax.grad(lambda v: jnp.sum(fake_quantize_mxfp8(v)))(x)).max()) == 0.0
