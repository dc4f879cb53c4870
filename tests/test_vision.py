"""The MoonViT tower and projector: parity with HF transformers' ``kimi_k25`` (the K2.5 variant) on a
tiny random config, packing isolation, the K3 variant's official-layout round trip."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import VisionConfig
from k3jax.vision.inputs import pack_images
from k3jax.vision.moonvit import MoonViT
from k3jax.vision.position import resample_position_table
from k3jax.vision.projector import Projector
from k3jax.vision.processor import ProcessedImage

pytestmark = pytest.mark.usefixtures("fast_xla")

# Tiny K2.5-style tower: LayerNorm, biases, bicubic table, patchmerger projector.
K25 = VisionConfig(enabled=True, patch_size=4, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, mlp_dim=48,
                   norm="layernorm", norm_eps=1e-5, bias=True, pos_emb_size=8, pos_interpolation="bicubic",
                   projector="patchmerger", max_patches=16384)
K3 = dataclasses.replace(K25, norm="rmsnorm", norm_eps=0.0, bias=False, pos_interpolation="bilinear",
                         projector="patchmergerv2")
TEXT_HIDDEN = 24
# Patch grids (h, w): smaller, equal to and larger than the 8 x 8 table, non-square.
GRIDS = [(4, 6), (8, 8), (2, 10), (12, 4)]


def _images(cfg, grids, seed=0):
    rng = np.random.default_rng(seed)
    p = cfg.patch_size
    return [ProcessedImage(rng.standard_normal((h * w, 3, p, p)).astype(np.float32), (h, w), (w * p, h * p))
            for h, w in grids]


def _hf_modules(cfg):
    torch = pytest.importorskip("torch")
    from transformers.models.kimi_k25 import configuration_kimi_k25 as c
    from transformers.models.kimi_k25 import modeling_kimi_k25 as m

    vc = c.Kimi_K25VisionConfig(
        patch_size=cfg.patch_size, pos_emb_height=cfg.pos_emb_size, pos_emb_width=cfg.pos_emb_size,
        num_attention_heads=cfg.num_heads, num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.mlp_dim, merge_kernel_size=(cfg.merge_size, cfg.merge_size),
        rope_parameters={"rope_type": "axial", "rope_theta": cfg.rope_theta})
    vc._attn_implementation = "eager"
    torch.manual_seed(0)
    tower = m.Kimi_K25VisionModel(vc).eval()
    full = c.Kimi_K25Config(text_config={"model_type": "deepseek_v3", "hidden_size": TEXT_HIDDEN},
                            vision_config=vc.to_dict(), projection_hidden_size=cfg.hidden_size)
    projector = m.Kimi_K25MultimodalProjection(full).eval()
    with torch.no_grad():  # every tensor random (norm gains and biases too), O(1) activations
        for mod in (tower, projector):
            for name, prm in mod.named_parameters():
                if prm.ndim == 1:  # norm gains around 1, biases around 0
                    prm.copy_(0.1 * torch.randn_like(prm) + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
                elif "position" in name:
                    prm.copy_(0.5 * torch.randn_like(prm))
                else:
                    prm.copy_(torch.randn_like(prm) / np.sqrt(prm[0].numel()))
    return torch, tower, projector


def _hf_to_official(tower, projector, cfg):
    """HF transformers' kimi_k25 tensors -> the release layout (inverse of its conversion_mapping:
    renames, q/k/v fused, q/k rows un-permuted from half-split to adjacent RoPE pairs)."""
    sd = {k: v.detach().numpy() for k, v in tower.state_dict().items()}
    h, k = cfg.num_heads, cfg.head_dim

    def unpermute(a):  # HF PermuteForRope: (H, K/2, 2) -> (H, 2, K/2); undo it
        return a.reshape((h, 2, k // 2) + a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    out = {"vision_tower.patch_embed.proj.weight": sd["patch_embed.proj.weight"],
           "vision_tower.patch_embed.proj.bias": sd["patch_embed.proj.bias"],
           "vision_tower.patch_embed.pos_emb.weight": sd["patch_embed.pos_emb.position_embeddings"]}
    for i in range(cfg.num_layers):
        s, o = f"layers.{i}.", f"vision_tower.encoder.blocks.{i}."
        for part in ("weight", "bias"):
            out[o + f"norm0.{part}"] = sd[s + f"norm1.{part}"]
            out[o + f"norm1.{part}"] = sd[s + f"norm2.{part}"]
            out[o + f"wqkv.{part}"] = np.concatenate([unpermute(sd[s + f"attn.q_proj.{part}"]),
                                                      unpermute(sd[s + f"attn.k_proj.{part}"]),
                                                      sd[s + f"attn.v_proj.{part}"]])
            out[o + f"wo.{part}"] = sd[s + f"attn.proj.{part}"]
            out[o + f"mlp.fc0.{part}"] = sd[s + f"mlp.fc1.{part}"]
            out[o + f"mlp.fc1.{part}"] = sd[s + f"mlp.fc2.{part}"]
    for part in ("weight", "bias"):
        out[f"vision_tower.encoder.final_layernorm.{part}"] = sd[f"final_layernorm.{part}"]
    pd = {k: v.detach().numpy() for k, v in projector.state_dict().items()}
    for part in ("weight", "bias"):
        out[f"mm_projector.pre_norm.{part}"] = pd[f"pre_norm.{part}"]
        out[f"mm_projector.proj.0.{part}"] = pd[f"in_proj.{part}"]
        out[f"mm_projector.proj.2.{part}"] = pd[f"out_proj.{part}"]
    return out


class _VisionOnly(nnx.Module):
    """The two vision attributes of K3Model, without the LM (what ``k3jax.vision.weights`` reads)."""

    def __init__(self, cfg, seed=0):
        rngs = nnx.Rngs(seed)
        with nnx.use_eager_sharding(False):
            self._build(cfg, rngs)

    def _build(self, cfg, rngs):
        self.vision_tower = MoonViT(cfg, init_std=0.02, dtype="float32", param_dtype=jnp.float32, rngs=rngs)
        self.mm_projector = Projector(cfg, TEXT_HIDDEN, init_std=0.02, dtype="float32", param_dtype=jnp.float32,
                                      rngs=rngs)


@nnx.jit
def _encode(model, inputs):
    merged = model.vision_tower(inputs)
    return merged, model.mm_projector(merged)


def _rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_parity_with_hf_kimi_k25_packed_images():
    """Several images of different sizes in one packed call: tower (pooled 2x2 merge) and projector
    match HF transformers' Kimi_K25VisionModel / Kimi_K25MultimodalProjection in float32."""
    from k3jax.vision.weights import load_vision

    torch, hf_tower, hf_proj = _hf_modules(K25)
    imgs = _images(K25, GRIDS)
    with torch.no_grad():
        pixel_values = torch.from_numpy(np.concatenate([im.patches for im in imgs]))
        grid_thw = torch.tensor([[1, h, w] for h, w in GRIDS])
        ref_merged = hf_tower(pixel_values, grid_thw).pooler_output  # [N, 4, D]
        ref_proj = hf_proj(ref_merged)[:, 0]  # [N, 1, d] -> [N, d]
    model = _VisionOnly(K25)
    official = _hf_to_official(hf_tower, hf_proj, K25)
    names = load_vision(model, official.__getitem__)
    assert sorted(names) == sorted(official)
    inputs = pack_images([imgs], K25.merge_size)
    merged, proj = _encode(model, inputs)
    n = int(inputs.merged_valid.sum())
    assert n == ref_merged.shape[0]
    err_tower = _rel_err(merged[0, :n], ref_merged.numpy())
    err_proj = _rel_err(proj[0, :n], ref_proj.numpy())
    print(f"parity vs HF kimi_k25 (fp32): tower {err_tower:.2e}, projector {err_proj:.2e}")
    assert err_tower < 1e-4 and err_proj < 1e-4


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_position_table_matches_torch_interpolate(mode):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    table = rng.standard_normal((8, 8, 5)).astype(np.float32)
    for h, w in [(3, 13), (8, 8), (16, 6), (1, 1)]:
        ref = torch.nn.functional.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(h, w), mode=mode,
                                              align_corners=False)[0].permute(1, 2, 0).numpy()
        rows, cols = np.divmod(np.arange(h * w), w)
        got = resample_position_table(jnp.asarray(table), jnp.asarray(rows), jnp.asarray(cols),
                                      jnp.full((h * w,), h), jnp.full((h * w,), w), mode)
        np.testing.assert_allclose(np.asarray(got), ref.reshape(h * w, 5), rtol=1e-5, atol=1e-5)


def test_packing_isolation():
    """An image alone gives the same features as the same image packed with others (in any slot),
    and as part of a batch row next to an empty row (K3 variant: RMSNorm, bilinear, no biases)."""
    model = _VisionOnly(K3, seed=3)
    a, b, c = _images(K3, [(4, 6), (6, 2), (2, 4)], seed=5)
    budget = 48
    alone = _encode(model, pack_images([[b]], K3.merge_size, max_patches=budget))[1][0, :3]
    packed = _encode(model, pack_images([[a, b, c], []], K3.merge_size, max_patches=budget))[1]
    np.testing.assert_allclose(np.asarray(packed[0, 6:9]), np.asarray(alone), rtol=1e-5, atol=1e-6)
    swapped = _encode(model, pack_images([[c], [b, a]], K3.merge_size, max_patches=budget))[1]
    np.testing.assert_allclose(np.asarray(swapped[1, :3]), np.asarray(alone), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(swapped[0, :2]), np.asarray(packed[0, 9:11]), rtol=1e-5, atol=1e-6)


def test_official_layout_round_trip_k3_variant():
    from k3jax.vision.weights import export_vision, load_vision

    src, dst = _VisionOnly(K3, seed=1), _VisionOnly(K3, seed=2)
    tensors = dict(export_vision(src))
    assert "mm_projector.post_norm.weight" in tensors and not any(k.endswith(".bias") for k in tensors)
    assert tensors["vision_tower.encoder.blocks.0.wqkv.weight"].shape == (3 * 2 * 16, 32)
    assert tensors["vision_tower.patch_embed.proj.weight"].shape == (32, 3, 4, 4)
    load_vision(dst, tensors.__getitem__)
    for (n1, v1), (n2, v2) in zip(nnx.iter_graph(src), nnx.iter_graph(dst)):
        if isinstance(v1, nnx.Param):
            np.testing.assert_array_equal(np.asarray(v1[...]), np.asarray(v2[...]), err_msg=str(n1))


def test_hf_checkpoint_round_trip_with_vision(tmp_path):
    """to_hf writes vision_tower.* / mm_projector.* and vision_config in the kimi_k3 layout; from_hf
    reads them back with vision.enabled=true, and skips them (with a warning) otherwise."""
    import json

    from k3jax.config import load_config
    from k3jax.interop import from_hf, to_hf
    from k3jax.model import create_model

    cfg = load_config("tiny_vl", ["model.num_layers=2"]).model
    model = create_model(cfg, seed=4)
    to_hf(model, tmp_path, model_type="kimi_k3")
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["vision_config"]["vt_hidden_size"] == cfg.vision.hidden_size
    assert hf_cfg["media_placeholder_token_id"] == cfg.vision.media_pad_id
    media = [f"vision.media_{k}_id={getattr(cfg.vision, f'media_{k}_id')}" for k in ("begin", "content", "end")]
    again = from_hf(tmp_path, overrides=["vision.enabled=true", *media])
    # the processor limits live in preprocessor_config.json, not config.json
    assert dataclasses.replace(again.cfg.vision, max_patches=cfg.vision.max_patches,
                               max_patches_per_side=cfg.vision.max_patches_per_side) == cfg.vision
    params = lambda m: [(p, v) for p, v in nnx.iter_graph(m) if isinstance(v, nnx.Param)]  # noqa: E731
    for (p1, v1), (p2, v2) in zip(params(model), params(again), strict=True):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(v1[...]), np.asarray(v2[...]), err_msg=str(p1))
    with pytest.warns(UserWarning, match="vision"):
        text_only = from_hf(tmp_path)
    assert not text_only.cfg.vision.enabled and not hasattr(text_only, "vision_tower")
