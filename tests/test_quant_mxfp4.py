"""The JAX MXFP4 quantizer (k3jax.quant.mxfp4, integer arithmetic on IEEE bits) against the
independent NumPy transcription (k3jax.interop.mxfp4, IEEE float arithmetic), bit for bit, on random
and adversarial blocks; packing; grid exactness; error bounds; straight-through gradients."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.interop import mxfp4 as ref
from k3jax.quant import straight_through
from k3jax.quant.formats import E2M1, GROUP_SIZE, SCALE_RULES
from k3jax.quant.mxfp4 import dequantize_mxfp4, fake_quantize_mxfp4, pack_nibbles, quantize_mxfp4, unpack_nibbles

# op-by-op and jitted programs compiled without XLA's optimisation passes (values are compared)
pytestmark = pytest.mark.usefixtures("fast_xla")

F32 = np.finfo(np.float32)


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def assert_same_floats(a, b):
    """Equal bit patterns, except that any NaN equals any NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(np.where(np.isnan(a), 0, bits(a)), np.where(np.isnan(b), 0, bits(b)))


def adversarial_blocks() -> np.ndarray:
    """[rows, 64] float32: two blocks per row of the cases where implementations part ways."""
    blocks = []

    def add(values):
        row = np.zeros(GROUP_SIZE, np.float32)
        row[: len(values)] = values
        blocks.append(row)

    add([])  # zeros
    add([-0.0] * 5)  # signed zeros
    add([2.0**-149, -(2.0**-149), 2.0**-140, 3 * 2.0**-149])  # smallest subnormals
    add(np.linspace(-(2.0**-126), 2.0**-126, 32))  # a block of subnormals up to the smallest normal
    add([2.0**-126, 2.0**-127, 1.5 * 2.0**-127, 2.0**-128, -(2.0**-130)])  # normal / subnormal boundary
    add([1.0, 2.0**-140, -(2.0**-135)])  # subnormal elements under a normal peak
    add([F32.max, -F32.max, F32.max / 3, 1.0])  # largest finite magnitudes
    add([F32.max, 2.0**127, 1.5 * 2.0**127])
    add([np.inf, 1.0])
    add([-np.inf, 2.0])
    add([np.nan, 1.0])
    add([1.0, -np.nan])
    add([np.inf, np.nan, -np.inf])
    # element ties in units of X = 1 (peak 6): 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 and their negatives
    add([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    add([6.0 * 2.0**-100, 0.25 * 2.0**-100, 0.75 * 2.0**-100])  # the same far down
    # scale ties: amax = 6 * 2**k and its neighbours (6 * 2**125 is below float32's largest)
    for k in (-130, -127, -126, -3, 0, 7, 125):
        t = np.float32(6.0 * 2.0**k)
        add([t, 0.5 * 2.0**k, 1.5 * 2.0**k])
        add([np.nextafter(t, np.float32(np.inf)), 0.5 * 2.0**k])
        add([np.nextafter(t, np.float32(0)), -0.5 * 2.0**k])
    for peak in (3.0, 4.0, 7.0, 7.99, 8.0):  # peak mantissas around the rules' thresholds
        add([peak, peak / 2, peak / 3, -peak / 5])
    x = np.stack(blocks)
    if len(x) % 2:
        x = np.concatenate([x, x[:1]])
    return x.reshape(-1, 2 * GROUP_SIZE)


def random_blocks(seed: int, rows: int = 64, cols: int = 256) -> np.ndarray:
    """Gaussian rows at scales from 2**-140 to 2**120, plus heavy tails and exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-140, 120, (rows, 1)))
    x[::7] = rng.standard_t(1.5, (len(x[::7]), cols))  # heavy-tailed rows: large peaks, tiny rest
    x[rng.random(x.shape) < 0.05] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("data", ["random", "adversarial"])
def test_jax_matches_numpy_transcription(rule, data):
    w = random_blocks(0) if data == "random" else adversarial_blocks()
    packed, scales = quantize_mxfp4(jnp.asarray(w), rule=rule)
    ref_packed, ref_scales = ref.encode(w, rule=rule)
    np.testing.assert_array_equal(np.asarray(scales), ref_scales)
    np.testing.assert_array_equal(np.asarray(packed), ref_packed)
    decoded = ref.decode(ref_packed, ref_scales, np.float32)
    assert_same_floats(dequantize_mxfp4(packed, scales, jnp.float32), decoded)
    assert_same_floats(fake_quantize_mxfp4(jnp.asarray(w), rule=rule), decoded)


def test_bfloat16_inputs_and_outputs():
    """bfloat16 goes in and out through the bits (no conversion that could flush subnormals)."""
    w = np.concatenate([random_blocks(1), adversarial_blocks()[:, :64].repeat(4, axis=1)[:64]], axis=0)
    w16 = w.astype(ml_dtypes.bfloat16)
    packed, scales = quantize_mxfp4(jnp.asarray(w16))
    ref_packed, ref_scales = ref.encode(w16.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(packed), ref_packed)
    np.testing.assert_array_equal(np.asarray(scales), ref_scales)
    out = np.asarray(dequantize_mxfp4(packed, scales, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    # every MXFP4 value is exact in bfloat16 (1 mantissa bit, the same exponent range)
    assert_same_floats(out.astype(np.float32), ref.decode(ref_packed, ref_scales, np.float32))
    fq = np.asarray(fake_quantize_mxfp4(jnp.asarray(w16)))
    assert fq.dtype == jnp.bfloat16
    assert_same_floats(fq.astype(np.float32), ref.decode(ref_packed, ref_scales, np.float32))


def test_every_byte_and_scale_decodes_as_the_spec():
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32)
    scales = np.array([[0, 1], [2, 126], [127, 128], [140, 200], [253, 254], [255, 3], [127, 127], [80, 170]],
                      np.uint8)
    got = np.asarray(dequantize_mxfp4(jnp.asarray(packed), jnp.asarray(scales), jnp.float32))
    for (o, i), v in np.ndenumerate(got):
        code = int(packed[o, i // 2]) >> (4 * (i % 2)) & 0xF
        s = int(scales[o, i // GROUP_SIZE])
        with np.errstate(over="ignore"):  # 6 * 2**127 overflows float32: inf, like the decoder
            want = np.float32(np.nan if s == 0xFF else E2M1.value(code) * 2.0 ** (s - 127))
        assert (np.isnan(v) and np.isnan(want)) or bits(v) == bits(want), (o, i, v, want)


def test_pack_unpack_round_trip_is_bit_exact():
    every = jnp.arange(256, dtype=jnp.uint8).reshape(4, 64)
    codes = unpack_nibbles(every)
    assert codes.shape == (4, 128) and int(codes.max()) == 15
    np.testing.assert_array_equal(np.asarray(codes[0, :4]), [0, 0, 1, 0])  # byte 0 -> (0, 0), byte 1 -> (1, 0)
    np.testing.assert_array_equal(np.asarray(pack_nibbles(codes)), np.asarray(every))
    rng = np.random.default_rng(2)
    packed = jnp.asarray(rng.integers(0, 256, (3, 16, 48)), jnp.uint8)
    scales = jnp.asarray(rng.integers(100, 150, (3, 16, 3)), jnp.uint8)
    # quantizing a decoded tensor with the scales it came from gives back the same bytes, where the
    # scale rule reproduces those scales: force it by re-encoding each block at its own scale
    w = dequantize_mxfp4(packed, scales, jnp.float32)
    again_packed, again_scales = quantize_mxfp4(w, rule="ceil")
    # ceil keeps every value; bytes are the same for blocks whose peak magnitude code is 6 or 7
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(again_packed, again_scales)), np.asarray(w))


@pytest.mark.parametrize("rule", ["ceil", "ocp"])
def test_values_on_the_grid_quantize_exactly(rule):
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (32, 128)).astype(np.uint8)
    scales = rng.integers(60, 190, (32, 4)).astype(np.uint8)
    grid = np.asarray(dequantize_mxfp4(pack_nibbles(jnp.asarray(codes)), jnp.asarray(scales)))
    np.testing.assert_array_equal(np.asarray(fake_quantize_mxfp4(jnp.asarray(grid), rule=rule)), grid)
    # blocks whose peak is 4 or 6 (in units of their scale) come back byte for byte
    packed, new_scales = quantize_mxfp4(jnp.asarray(grid), rule=rule)
    peak = (codes & 7).reshape(32, 4, GROUP_SIZE).max(-1)
    same = peak >= 6
    np.testing.assert_array_equal(np.asarray(new_scales)[same], scales[same])


def test_aiter_rule_grid_exactness_except_at_peak_six():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, (64, 64)).astype(np.uint8)
    codes[:32, ::GROUP_SIZE] = 7  # half the blocks peak at 6
    codes[32:] &= 0b1110  # the others: even magnitude codes only, peak below 6
    grid = np.asarray(dequantize_mxfp4(pack_nibbles(jnp.asarray(codes)), jnp.full((64, 2), 127, jnp.uint8)))
    again = np.asarray(fake_quantize_mxfp4(jnp.asarray(grid), rule="aiter"))
    np.testing.assert_array_equal(again[32:], grid[32:])
    moved = np.isin(codes[:32] & 7, [1, 3])  # 0.5 and 1.5 have no place on the doubled grid
    np.testing.assert_array_equal(again[:32] != grid[:32], moved)


def aiter_f32_to_e8m0(x: np.ndarray) -> np.ndarray:
    """AITER's f32_to_e8m0 bit trick."""
    u = np.asarray(x, np.float32).view(np.uint32)
    exponent = (u >> 23) & 0xFF
    round_up = ((u & 0x400000) > 0) & (((u & 0x200000) > 0) | ((u & 0x1FFFFF) > 0) | (exponent > 0))
    return (exponent + round_up).astype(np.int64)


def test_aiter_rule_matches_the_aiter_bit_trick():
    """For every normal amax / 4 the 'aiter' rule is AITER's byte (subnormal amax/4 differs by design)."""
    w = random_blocks(5, rows=256, cols=64)
    amax = np.abs(w.reshape(-1, GROUP_SIZE)).max(-1)
    keep = amax >= 2.0**-124
    _, scales = quantize_mxfp4(jnp.asarray(w), rule="aiter")
    got = np.asarray(scales).reshape(-1)[keep]
    np.testing.assert_array_equal(got, aiter_f32_to_e8m0(amax[keep] / np.float32(4.0)))


@pytest.mark.parametrize("rule", ["ceil", "aiter"])
def test_error_bound_no_clip_rules(rule):
    """Every element is within half a grid step of its value: the grid step at |x| / X in [0, 2) is
    X / 2, in [2, 4) X, in [4, 8) 2 X; and no element saturates."""
    w = random_blocks(6)
    w = w[np.isfinite(w).all(-1)]
    _, scales = quantize_mxfp4(jnp.asarray(w), rule=rule)
    x_scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - 127), GROUP_SIZE, axis=-1)
    q = np.asarray(fake_quantize_mxfp4(jnp.asarray(w), rule=rule), np.float64)
    y = np.abs(w.astype(np.float64)) / x_scale
    assert (y <= E2M1.max_value).all()  # no clipping
    step = np.where(y < 2, 0.5, np.where(y < 4, 1.0, 2.0)) * x_scale
    assert (np.abs(q - w) <= step / 2).all()
    # relative to the block peak: at most 1/4 (a half step is X at most, and only where amax / X >= 4),
    # except in blocks whose scale is clamped at E8M0's smallest (amax < 2**-125: amax / X below 3)
    blocks = lambda a: a.reshape(len(a), -1, GROUP_SIZE)  # noqa: E731
    peak = np.abs(blocks(w.astype(np.float64))).max(-1, keepdims=True)
    err = np.abs(blocks(q - w))
    normal_scale = (np.asarray(scales) > 0)[..., None]
    assert normal_scale.mean() > 0.8 and (err <= peak / 4)[np.broadcast_to(normal_scale, err.shape)].all()


def test_error_bound_ocp_rule_clips_to_six():
    w = random_blocks(7)
    w = w[np.isfinite(w).all(-1)]
    _, scales = quantize_mxfp4(jnp.asarray(w), rule="ocp")
    x_scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - 127), GROUP_SIZE, axis=-1)
    q = np.asarray(fake_quantize_mxfp4(jnp.asarray(w), rule="ocp"), np.float64)
    y = np.abs(w.astype(np.float64)) / x_scale
    clipped = y > E2M1.max_value
    assert clipped.any() and (y < 8).all()
    np.testing.assert_array_equal(np.abs(q[clipped]), E2M1.max_value * x_scale[clipped])
    step = np.where(y < 2, 0.5, np.where(y < 4, 1.0, 2.0)) * x_scale
    assert (np.abs(q - w)[~clipped] <= step[~clipped] / 2).all()


def test_fake_quantize_along_the_input_axis_of_k3jax_weights():
    """k3jax stores experts (E, in, out): blocks along axis -2 equal the release orientation's."""
    w = random_blocks(8, rows=4 * 64, cols=96).reshape(4, 64, 96)
    got = fake_quantize_mxfp4(jnp.asarray(w), axis=-2)
    want = np.swapaxes(ref.quantize_dequantize(np.swapaxes(w, -1, -2)), -1, -2)
    assert_same_floats(got, want)
    with pytest.raises(ValueError, match="multiple of 32"):
        fake_quantize_mxfp4(jnp.zeros((4, 48, 32)), axis=-2)


def test_straight_through_gradient_is_the_identity():
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((64, 32)) * 0.02, jnp.float32)  # (in, out)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    fq = straight_through(lambda v: fake_quantize_mxfp4(v, axis=-2))
    np.testing.assert_array_equal(np.asarray(fq(w)), np.asarray(fake_quantize_mxfp4(w, axis=-2)))  # exact forward
    g = jax.grad(lambda v: jnp.sum(fq(v) * jnp.arange(v.size, dtype=v.dtype).reshape(v.shape)))(w)
    np.testing.assert_array_equal(np.asarray(g), np.arange(w.size, dtype=np.float32).reshape(w.shape))
    # through a matmul: dL/dw is the gradient with respect to the quantized weight, x^T dL/dy
    loss = lambda v: jnp.sum(jnp.tanh(x @ fq(v)))  # noqa: E731
    wq = fake_quantize_mxfp4(w, axis=-2)
    dy = 1 - jnp.tanh(x @ wq) ** 2
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(w)), np.asarray(x.T @ dy), rtol=1e-5, atol=1e-6)
    # without the STE the rounding has a zero gradient almost everywhere
    plain = jax.grad(lambda v: jnp.sum(fake_quantize_mxfp4(v, axis=-2)))(w)
    assert float(jnp.abs(plain).max()) == 0.0
