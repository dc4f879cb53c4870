"""The NumPy MXFP4 codec (k3jax.interop.mxfp4) against a direct transcription of the OCP Microscaling
v1.0 spec, element by element."""

import numpy as np
import pytest

from k3jax.interop import mxfp4
from k3jax.quant.formats import E2M1, SCALE_RULES


def ocp_e2m1(code: int) -> float:
    """OCP MX v1.0 §5.3.3: FP4 E2M1, 1 sign, 2 exponent (bias 1), 1 mantissa bit; no inf/NaN."""
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = (m / 2) * 2.0 ** (1 - 1) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


def ocp_e8m0(byte: int) -> float:
    """OCP MX v1.0 §5.4.1: E8M0 scale, 2^(byte - 127), 0xFF = NaN."""
    return float("nan") if byte == 0xFF else 2.0 ** (byte - 127)


def ocp_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Element by element: low nibble = even column (compressed-tensors / gpt-oss packing)."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.float64)
    for idx in np.ndindex(*packed.shape):
        *lead, j = idx
        byte = int(packed[idx])
        for half, code in ((0, byte & 0xF), (1, byte >> 4)):
            i = 2 * j + half
            out[(*lead, i)] = ocp_e2m1(code) * ocp_e8m0(int(scale[(*lead, i // 32)]))
    return out


def test_decode_every_byte_and_scale_against_ocp():
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32)  # every code pair
    scale = np.array([[0, 1], [100, 126], [127, 128], [140, 200], [254, 255], [3, 127], [127, 127], [80, 170]],
                     np.uint8)
    got = mxfp4.decode(packed, scale, np.float64)
    ref = ocp_decode(packed, scale)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(ref))
    assert got[0, 0] == 0.0 and ocp_e8m0(0) == 2.0 ** -127  # byte 0 is 2^-127, not zero


def test_lut_matches_spec():
    assert [ocp_e2m1(c) for c in range(8)] == list(mxfp4.E2M1_VALUES) == [E2M1.value(c) for c in range(8)]
    assert [ocp_e2m1(c) for c in range(8, 16)] == [-v for v in mxfp4.E2M1_VALUES]


@pytest.mark.parametrize("rule", ["ceil", "ocp"])
def test_encode_decode_is_idempotent(rule):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 64)).astype(np.float32) * np.exp2(rng.integers(-20, 20, (3, 5, 1)))
    q = mxfp4.quantize_dequantize(w, rule=rule)
    np.testing.assert_array_equal(mxfp4.quantize_dequantize(q, rule=rule), q)  # grid values stay exact
    packed, scale = mxfp4.encode(w, rule=rule)
    assert packed.shape == (3, 5, 32) and scale.shape == (3, 5, 2) and packed.dtype == scale.dtype == np.uint8
    np.testing.assert_array_equal(ocp_decode(packed, scale).astype(np.float32), q)


def test_aiter_rule_is_not_idempotent_at_peak_six():
    """At amax = 6 * 2**k the aiter rule doubles the scale: a decoded block peaking at 6 loses its 0.5s."""
    w = np.zeros((1, 32), np.float32)
    w[0, :3] = [6.0, 0.5, 1.5]
    assert mxfp4.encode(w, rule="aiter")[1][0, 0] == 127 + 1
    assert list(mxfp4.quantize_dequantize(w, rule="aiter")[0, :3]) == [6.0, 0.0, 2.0]  # ties to even
    np.testing.assert_array_equal(mxfp4.quantize_dequantize(w, rule="ceil"), w)


def test_scale_rules_peaks():
    """Peaks (in units of X) each rule produces for amax = M * 2**k, M in [1, 2)."""
    w = np.zeros((6, 32), np.float32)
    w[:, 0] = [4.0, 5.0, 5.9, 6.0, 6.2, 7.9]
    exps = {r: mxfp4.shared_exponent(np.abs(w).max(-1), r).tolist() for r in SCALE_RULES}
    assert exps["ceil"] == [0, 0, 0, 0, 1, 1]
    assert exps["aiter"] == [0, 0, 0, 1, 1, 1]
    assert exps["ocp"] == [0, 0, 0, 0, 0, 0]


def test_ceil_rule_never_clips_and_ocp_rule_does():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 7.0, 0.5  # peak mantissa 1.75 > 1.5
    ceil = mxfp4.quantize_dequantize(w, rule="ceil")
    ocp = mxfp4.quantize_dequantize(w, rule="ocp")
    assert ceil[0, 0] == 8.0  # X = 2: 7/2 = 3.5 -> 4 (ties to even)
    assert ocp[0, 0] == 6.0  # X = 1: 7 clips to 6
    assert mxfp4.shared_exponent(np.float32(6.0), "ceil") == 0 and mxfp4.shared_exponent(np.float32(6.0), "ocp") == 0


def test_round_to_nearest_even_and_saturation():
    x = np.zeros((1, 32), np.float32)
    x[0, :12] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, -6.0, 0.2, -0.3]  # amax 6: X = 1
    got = mxfp4.quantize_dequantize(x)
    assert list(got[0, :12]) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, -6.0, 0.0, -0.5]
    y = np.zeros((1, 32), np.float32)
    y[0, :2] = [6.5, -100.0]
    assert mxfp4.encode(y)[1][0, 0] == 127 + 5  # ceil(log2(100 / 6)) = 5
    y[0, 1] = 1.0
    assert mxfp4.quantize_dequantize(y, rule="ocp")[0, 0] == 6.0  # floor rule: X = 1, 6.5 saturates


def test_zero_block_signed_zero_and_nan_scale():
    packed, scale = mxfp4.encode(np.zeros((2, 32), np.float32))
    assert (packed == 0).all() and (scale == 127).all()
    neg = np.zeros((1, 32), np.float32)
    neg[0, 0], neg[0, 2], neg[0, 4] = -0.0, 1.0, -0.01  # X = 1/4: -0.01 rounds to zero, keeps its sign like -0.0
    codes = mxfp4.encode(neg)[0]  # byte j holds columns 2j (low nibble) and 2j + 1
    assert codes[0, 0] & 0xF == 8 and codes[0, 2] & 0xF == 8 and np.signbit(mxfp4.decode(*mxfp4.encode(neg))[0, 0])
    assert np.isnan(mxfp4.decode(np.zeros((1, 16), np.uint8), np.array([[255]], np.uint8))).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_block_decodes_to_nan(bad):
    w = np.ones((2, 64), np.float32)
    w[1, 40] = bad
    packed, scale = mxfp4.encode(w)
    assert scale.tolist() == [[127 - 2, 127 - 2], [127 - 2, 0xFF]] and (packed[1, 16:] == 0).all()
    out = mxfp4.decode(packed, scale)
    assert np.isnan(out[1, 32:]).all() and np.isfinite(out[:, :32]).all() and np.isfinite(out[0]).all()


def test_packed_orientation():
    rng = np.random.default_rng(1)
    w_hf = mxfp4.quantize_dequantize(rng.standard_normal((2, 8, 64)).astype(np.float32))  # [E, out, in]
    p = mxfp4.PackedMXFP4(*mxfp4.encode(w_hf))
    assert p.logical_shape == (2, 64, 8)  # k3jax (in, out)
    np.testing.assert_array_equal(p.dequantize(), np.swapaxes(w_hf, -1, -2))


def test_bad_shapes_and_rules():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.encode(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="disagree"):
        mxfp4.decode(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="scale rule"):
        mxfp4.encode(np.zeros((2, 32), np.float32), rule="floor")
