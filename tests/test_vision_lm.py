"""Images in the LM: processor, placeholder expansion, splice, text path unchanged, a multimodal train
step, generation with an image, the bundled image-caption pipeline."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import VisionConfig, load_config
from k3jax.data.images import SyntheticCaptions, make_multimodal_dataset, vision_batch
from k3jax.tokenizer import ByteTokenizer
from k3jax.inference.generate import generate
from k3jax.model import create_model
from k3jax.vision.inputs import pack_images
from k3jax.vision.processor import build_tokens, image_token_ids, media_mask, process_image, target_size
from k3jax.vision.splice import splice_image_features

pytestmark = pytest.mark.usefixtures("fast_xla")

# tiny_vl with a 2-layer LM ([KDA + dense FFN, MLA + MoE]): every mechanism, a fast compile.
OVERRIDES = ["model.num_layers=2", "train.batch_size=2", "train.seq_len=64"]


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny_vl", OVERRIDES)


@pytest.fixture(scope="module")
def model(cfg):
    return create_model(cfg.model, seed=0)


def _image(seed, w, h):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------- processor


def test_target_size_follows_the_release_rule():
    k3 = VisionConfig()
    assert target_size(640, 480, k3) == ((640, 480), (644, 504))  # fits: no resize, pad to 28
    (w, h), (pw, ph) = target_size(8000, 1000, k3)  # one side over 512 patches: scaled to 7168 px
    assert w == 7168 and h == int(1000 * 7168 / 8000) and pw % 28 == 0 and ph % 28 == 0
    (w, h), _ = target_size(5000, 5000, k3)  # total budget: 65536 patches -> 256 x 256
    assert (w // 14) * (h // 14) <= 65536 and w == int(5000 * (65536 / (357 * 357)) ** 0.5)
    assert target_size(5, 3, k3) == ((5, 3), (28, 28))


def test_process_image_patch_layout_and_alpha():
    cfg = VisionConfig(patch_size=2, merge_size=2, max_patches=1000, max_patches_per_side=100)
    img = _image(0, 8, 4)
    out = process_image(img, cfg)
    assert out.grid_hw == (2, 4) and out.size_wh == (8, 4) and out.patches.shape == (8, 3, 2, 2)
    norm = (img.astype(np.float32) / 255 - 0.5) / 0.5
    # patch (r, c) holds pixels [2r:2r+2, 2c:2c+2], channels first
    np.testing.assert_allclose(out.patches[1 * 4 + 2], norm[2:4, 4:6].transpose(2, 0, 1), atol=1e-6)
    padded = process_image(_image(1, 5, 3), cfg)  # padded right / bottom with black (-1 after norm)
    assert padded.grid_hw == (2, 4)
    assert np.all(padded.patches[3][:, :, 1] == -1.0) and np.all(padded.patches[4:][:, :, 1] == -1.0)
    rgba = np.zeros((4, 8, 4), np.uint8)  # fully transparent: the chessboard (white top-left square)
    board = process_image(rgba, cfg)
    assert np.allclose(board.patches[0], 1.0)


def test_placeholder_block_and_media_mask():
    cfg = load_config("tiny_vl").model.vision
    tok = ByteTokenizer()
    img = process_image(_image(0, 40, 24), cfg)  # 5 x 3 patches -> padded 6 x 4 -> 3 x 2 tokens... of 2x2
    ids = image_token_ids(img, cfg, tok.encode)
    assert ids[0] == cfg.media_begin_id and ids[-1] == cfg.media_end_id
    assert tok.decode(ids[1:ids.index(cfg.media_content_id)]) == "image 40x24"
    assert ids.count(cfg.media_pad_id) == img.num_tokens(cfg.merge_size) == (img.grid_hw[0] // 2) * (img.grid_hw[1] // 2)
    seq, images = build_tokens(["Look: ", img, " a cat"], cfg, tok.encode)
    assert len(images) == 1 and tok.decode(seq) == "Look:  a cat".replace("  ", " " + tok.decode(ids) + " ")
    mask = media_mask(np.asarray(seq), cfg)
    start = len("Look: ")
    assert not mask[:start].any() and mask[start:start + len(ids)].all() and not mask[start + len(ids):].any()


def test_splice_puts_features_at_pads_in_order():
    x = jnp.zeros((2, 6, 3))
    tokens = jnp.asarray([[1, 9, 9, 2, 9, 3], [9, 1, 1, 1, 1, 1]])
    feats = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3) + 1
    out = splice_image_features(x, tokens, feats, pad_id=9)
    np.testing.assert_array_equal(out[0, [1, 2, 4]], feats[0, :3])
    np.testing.assert_array_equal(out[1, 0], feats[1, 0])
    assert float(jnp.abs(out[0, [0, 3, 5]]).sum()) == 0 and float(jnp.abs(out[1, 1:]).sum()) == 0


# ----------------------------------------------------------------------------- the LM with images


def test_text_path_unchanged_by_the_vision_switch(cfg, model):
    """Vision parameters are created after the LM's: same seed, same LM weights, same text logits."""
    text_cfg = dataclasses.replace(cfg.model, vision=dataclasses.replace(cfg.model.vision, enabled=False))
    text_model = create_model(text_cfg, seed=0)
    assert not hasattr(text_model, "vision_tower")
    tokens = jnp.asarray([list(b"In the beginning")], jnp.int32)
    a, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
    b, _ = nnx.jit(lambda m, t: m(t))(text_model, tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _prompt(cfg, image, text="Describe: "):
    ids, images = build_tokens([image, text], cfg.model.vision, ByteTokenizer().encode)
    return np.asarray([ids], np.int32), pack_images([images], cfg.model.vision.merge_size)


def test_images_reach_the_logits_causally(cfg, model):
    """Patches and precomputed features give the same logits; a different image changes the logits
    from its block on, never before it."""
    t1, v1 = _prompt(cfg, _image(0, 40, 32))
    t2, v2 = _prompt(cfg, _image(1, 40, 32))
    prefix = np.asarray([list(b"Hi ")], np.int32)
    t1, t2 = np.concatenate([prefix, t1], 1), np.concatenate([prefix, t2], 1)
    assert np.array_equal(t1, t2)  # same size -> same tokens; only the pixels differ
    fwd = nnx.jit(lambda m, t, v: m(t, images=v)[0])
    a, b = fwd(model, t1, v1), fwd(model, t2, v2)
    feats = nnx.jit(lambda m, v: m.encode_images(v))(model, v1)
    np.testing.assert_allclose(np.asarray(fwd(model, t1, feats)), np.asarray(a), rtol=1e-6, atol=1e-6)
    first_pad = int(np.argmax(t1[0] == cfg.model.vision.media_pad_id))
    np.testing.assert_array_equal(np.asarray(a[0, :first_pad]), np.asarray(b[0, :first_pad]))
    assert float(jnp.max(jnp.abs(a[0, first_pad:] - b[0, first_pad:]))) > 1e-4


@pytest.mark.slow
def test_generate_with_an_image_matches_the_full_forward(cfg, model):
    tokens, vis = _prompt(cfg, _image(2, 48, 40), "A")
    out = generate(model, tokens, 3, images=vis)
    logits = nnx.jit(lambda m, t, v: m(t, images=v)[0])(model, tokens, vis)
    assert out.shape == (1, tokens.shape[1] + 3)
    assert int(out[0, tokens.shape[1]]) == int(jnp.argmax(logits[0, -1]))


# ----------------------------------------------------------------------------- data and training


def test_bundled_image_caption_batches(cfg):
    records = SyntheticCaptions(n=16)
    r = records[3]
    assert r["image"].dtype == np.uint8 and r["text"].startswith("a ") and records[3]["text"] == r["text"]
    it = iter(make_multimodal_dataset(cfg.train, cfg.model.vision, ByteTokenizer(), records=records))
    batch = next(it)
    v = cfg.model.vision
    assert batch["tokens"].shape == (2, 64) and batch["image_patches"].shape == (2, v.max_patches, 3, 8, 8)
    for row in range(2):
        pads = int((batch["tokens"][row] == v.media_pad_id).sum())
        assert pads == int(batch["image_merged_valid"][row].sum()) > 0
        inside = media_mask(np.where(batch["targets"][row] < 0, 0, batch["targets"][row]), v)
        assert np.all(batch["loss_mask"][row][inside] == 0)
        assert batch["loss_mask"][row].sum() > 0  # the caption counts
        caption = ByteTokenizer().decode(batch["targets"][row][batch["loss_mask"][row] > 0])
        assert " background" in caption
    state = it.get_state()
    nxt = next(it)
    it.set_state(state)
    np.testing.assert_array_equal(next(it)["tokens"], nxt["tokens"])


@pytest.mark.slow
def test_multimodal_train_step_updates_the_tower(cfg, model):
    from k3jax.optim import make_optimizer
    from k3jax.training.step import TrainState, make_train_step

    tc = dataclasses.replace(cfg.train, grad_accum=2)
    run_cfg = dataclasses.replace(cfg, train=tc)
    it = iter(make_multimodal_dataset(tc, cfg.model.vision, ByteTokenizer(), records=SyntheticCaptions(n=16)))
    m = create_model(cfg.model, seed=1)
    ts = TrainState(m, make_optimizer(tc.optim, m, tc.steps))
    before = np.asarray(ts.model.vision_tower.blocks[0].fc0[...]).copy()
    graphdef, state = nnx.split(ts)
    step = make_train_step(graphdef, run_cfg)
    losses = []
    for _ in range(2):
        state, metrics = step(state, next(it))
        losses.append(float(metrics["loss"]))
        assert bool(metrics["finite"])
    after = np.asarray(nnx.merge(graphdef, state).model.vision_tower.blocks[0].fc0[...])
    assert np.all(np.isfinite(losses)) and not np.allclose(before, after)
    assert vision_batch({"tokens": 0}) is None
