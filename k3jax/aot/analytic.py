"""The analytic cost model of a config: parameters and forward FLOPs per token, per part, from the config alone.

The one home of these formulas: ``k3jax.params`` (the counts), ``k3jax.aot`` (model FLOPs, Newton-Schulz),
``k3jax.aot.breakdown`` (the analytic column of its table), ``bench/train_step.py`` / ``bench/gpu.py``
(achieved FLOP/s) and the tests use them. Nothing is built: the counts are closed forms of the
``ModelConfig`` fields (``tests/test_analytic.py`` checks them against the abstract model's leaves for
every config in ``configs/``, with dense and quantized experts and with LoRA adapters).

**Parts** are ``k3jax.aot.breakdown.PARTS``' names (the ``jax.named_scope`` names the model puts on its
work), plus ``lora`` for LoRA adapters. A decoder layer's ``attn_norm`` belongs to its mixer, its
``ffn_norm`` to its router (a dense layer's to ``dense_ffn``), its AttnRes mixes and the final readout
to ``attn_res``, ``final_norm`` and ``lm_head`` to ``lm_head_loss``, MoonViT and its projector to
``vision``; a MoE layer's ``down`` / ``up`` / ``latent_norm`` to ``latent_proj``.

**Parameters** (docs/design.md "Parameter counting"): *total* is every trainable weight of the model.
A compressed routed expert (``quant.experts=mxfp4 / int4 / fp8_block``: codes and scales, not
``nnx.Param``) counts as the dense weight it stands for, so the counts do not depend on storage.
*Active* is what one token multiplies through: the routed experts count ``top_k / num_experts`` of
themselves, the input embedding table nothing (a lookup) unless it is tied to the head, where it
counts under ``lm_head_loss`` (the head's matmul). The router's balancing bias is state, not a weight.
LoRA adapters (``train.lora``) are the ``lora`` part, all active. The vision tower counts whole, as
active (it runs per image patch, not per text token: its ``2 N`` per text token is a convention).

**FLOPs per token**, forward, all layers and heads: ``2 x`` the active parameters of each part (every
weight is one multiply-add per token; the norms, gains and convolution taps are counted alike, a
rounding error), plus the token mixing that is not a weight matmul (:func:`mixing_flops_per_token`).
A training step is ``3x`` the forward (backward = two matmuls per forward one); a LoRA run's frozen
weights skip their weight gradients, which this convention does not model.

- **MLA** (training / a forward over ``T`` tokens): causal softmax attention, each token's query against
  ``T / 2`` keys on average: ``2 H (d_qk + d_v) T / 2``. **Decode** and **prefill** (tokens against a
  cache of ``S``, the absorbed form of ``layers/mla.py``): scores over the latent and rope key
  ``2 H (r + R) S`` and the latent values ``2 H r S``. (The absorbed ``W_UK`` / ``W_UV`` products are ``kv_b``'s weight
  FLOPs, counted in the ``2 N`` term.)
- **KDA**, chunkwise (``ops/kda.py: chunk_kda``, ``ops/kda_chunk.py``), per head and token, chunk ``C``
  (``min(chunk_size, T)`` rounded up to a power of two), head dims ``K = V``, sub-tile ``B_c =
  min(16, C)``; every product over a whole ``C x C`` tile as the op runs it (the causal mask is applied
  after, not skipped):

  ======================================  ================================  ===========================
  step                                    shapes per chunk                  FLOPs per token
  ======================================  ================================  ===========================
  scores ``A_qk``, ``A_kk``               ``2 x [C, K] @ [K, C]``           ``4 C K``
  ``(I + L)^-1`` (doubling on the         ``C / B_c`` blocks ``B_c^3``,     ``C^2 + B_c C + 4 (log2 B_c
  diagonal blocks, block substitution)    rows ``[B_c, aB_c] @ [aB_c, C]``  - 1) B_c^2``
  ``[U | W] = X Diag(beta) [V | Gk]``     ``[C, C] @ [C, V + K]``           ``2 C (K + V)``
  ``delta = U - W S``                     ``[C, K] @ [K, V]``               ``2 K V``
  ``S += (k')^T delta``                   ``[K, C] @ [C, V]``               ``2 K V``
  ``o = (q G) S + A_qk delta``            ``[C, K] @ [K, V]``, ``[C, C] @   ``2 K V + 2 C V``
                                          [C, V]``
  ======================================  ================================  ===========================

  In all ``6 C K + 4 C V + 6 K V`` plus the inverse; a gate that does not guarantee the dense diagonal
  sub-tiles (anything but ``gate=lower_bound`` with ``B_c * gate_lower_bound >= -80``) also runs the
  exact path's anchored scores between its 4-row blocks, ``4 B_c K`` more (the elementwise products
  inside the blocks are not matmuls). ``k3jax.aot.breakdown`` counts exactly these on the compiled op
  (it counts a conditional's costlier branch: the exact path). For K3 (``C = 64``, ``K = V = 128``,
  dense) that is 188,416 FLOPs per head and token. **Decode** is one recurrent step: ``k^T S``, the
  rank-1 update and ``q^T S``, ``6 K V``.

**Newton-Schulz** (:func:`newton_schulz_flops`): the Muon blocks are ``k3jax.optim``'s (one home for
that grouping), read off the abstract model's parameter shapes.
"""

from __future__ import annotations

import math
from typing import Literal

from k3jax.config import Config, LoRAConfig, ModelConfig
from k3jax.layer_plan import layer_kind
from k3jax.ops.kda_chunk import DENSE_MIN_SUM, MAX_CHUNK, SUBTILE
from k3jax.vision.moonvit import NUM_CHANNELS

# train / forward: a step over rows of ``seq_len`` tokens; decode: one token per row against a cache of
# ``seq_len``; prefill: a chunk of prompt tokens per row written into such a cache (serving's chunked
# prefill), attending over all of it (the last chunk's work, an upper bound) and at least ``chunk_size``
# tokens long (KDA runs its full chunks).
Mode = Literal["train", "forward", "decode", "prefill"]
# Forward FLOPs -> FLOPs of a step: training runs the backward pass too (two matmuls per forward one).
STEP_FACTOR = {"train": 3, "forward": 1, "decode": 1, "prefill": 1}


# ---------------------------------------------------------------------------------------------
# Parameters

def _projections(cfg: ModelConfig, kind: str) -> dict[str, tuple[int, int]]:
    """The matrices of a ``kind`` module (a key of ``run_config.LORA_SITES``) that it has, as (inputs,
    outputs): the sites LoRA may adapt; head axes are flattened into the side they sit on."""
    d = cfg.hidden_size
    if kind == "mla":
        c = cfg.mla
        h, out = c.num_heads, {}
        if c.q_lora_rank:
            out |= {"q_a": (d, c.q_lora_rank), "q_b": (c.q_lora_rank, h * c.qk_head_dim)}
        else:
            out["q_proj"] = (d, h * c.qk_head_dim)
        out |= {"kv_a": (d, c.kv_lora_rank + c.qk_rope_head_dim),
                "kv_b": (c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))}
        if c.output_gate:
            out["g_proj"] = (d, h * c.v_head_dim)
        return out | {"o_proj": (h * c.v_head_dim, d)}
    if kind == "kda":
        c = cfg.kda
        hk = c.num_heads * c.head_dim
        out = {"q_proj": (d, hk), "k_proj": (d, hk), "v_proj": (d, hk), "b_proj": (d, c.num_heads)}
        if c.output_gate == "full":
            out["g_proj"] = (d, hk)
        elif c.output_gate == "low_rank":
            out |= {"g_a": (d, c.rank), "g_b": (c.rank, hk)}
        return out | {"o_proj": (hk, d)}
    width = cfg.dense_ffn_dim if kind == "ffn" else cfg.moe.expert_dim * cfg.moe.num_shared_experts
    return {"w_gate": (d, width), "w_up": (d, width), "w_down": (width, d)}


def _matrices(cfg: ModelConfig, kind: str) -> int:
    return sum(i * o for i, o in _projections(cfg, kind).values())


def _mixer_params(cfg: ModelConfig, mixer: str) -> int:
    """One mixer's parameters, its pre-norm (``attn_norm``) included."""
    d = cfg.hidden_size
    if mixer == "mla":
        c = cfg.mla
        norms = c.kv_lora_rank + c.q_lora_rank  # kv_a_norm, q_a_norm (absent with q_lora_rank = 0)
        return d + _matrices(cfg, "mla") + norms
    c = cfg.kda
    h, k = c.num_heads, c.head_dim
    conv = 3 * c.conv_size * h * k  # q, k, v depthwise taps
    forget_gate = d * c.rank + c.rank * h * k + h + h * k  # f_a, f_b, A_log, dt_bias
    return d + _matrices(cfg, "kda") + conv + forget_gate + k  # + o_norm


def _vision_params(cfg: ModelConfig) -> int:
    """MoonViT (``vision/moonvit.py``) and its projector (``vision/projector.py``)."""
    v = cfg.vision
    D, hk, f = v.hidden_size, v.num_heads * v.head_dim, v.mlp_dim
    norm = D * (2 if v.norm == "layernorm" else 1)  # gain (and bias)
    block = 2 * norm + D * 3 * hk + hk * D + 2 * D * f + (3 * hk + D + f + D if v.bias else 0)
    tower = NUM_CHANNELS * v.patch_size ** 2 * D + (D if v.bias else 0) + v.pos_emb_size ** 2 * D
    tower += v.num_layers * block + norm
    width = D * v.merge_size ** 2
    projector = width * width + width * cfg.hidden_size
    projector += 2 * D + width + cfg.hidden_size if v.projector == "patchmerger" else cfg.hidden_size
    return tower + projector


def _lora_params(cfg: ModelConfig, lora: LoRAConfig, mixer: str, ffn: str) -> int:
    """A layer's adapters: ``A [in, r]`` and ``B [r, out]`` per targeted matrix it has."""
    kinds = [mixer] + (["ffn"] if ffn == "dense" else ["shared"] if cfg.moe.num_shared_experts else [])
    total = 0
    for kind in kinds:
        matrices = _projections(cfg, kind)
        total += sum(lora.rank * sum(matrices[s]) for s in lora.sites(kind) if s in matrices)
    return total


def params_by_part(cfg: ModelConfig, lora: LoRAConfig | None = None) -> dict[str, int]:
    """Every parameter of the model by part (module docstring), compressed experts as the weights they
    stand for; ``lora``: with the adapters of that config (when enabled)."""
    d, m = cfg.hidden_size, cfg.moe
    out = dict.fromkeys(("embedding", "kda", "mla", "attn_res", "router", "latent_proj", "routed_experts",
                         "shared_experts", "dense_ffn", "lm_head_loss", "vision", "lora"), 0)
    out["embedding"] = cfg.vocab_size * d
    out["lm_head_loss"] = d + (0 if cfg.tie_embeddings else d * cfg.vocab_size)  # final_norm, lm_head
    res_mix = 2 * d  # AttnResMix: query and norm gain
    out["attn_res"] = res_mix * (2 * cfg.num_layers + 1) if cfg.attn_res.enabled else 0
    width = m.latent_dim or d
    for i in range(cfg.num_layers):
        mixer, ffn = layer_kind(cfg, i)
        out[mixer] += _mixer_params(cfg, mixer)
        if ffn == "dense":
            out["dense_ffn"] += d + _matrices(cfg, "ffn")  # ffn_norm + the GLU
        else:
            out["router"] += d + d * m.num_experts  # ffn_norm + router
            if m.latent_dim:
                out["latent_proj"] += 2 * d * width + (width if m.latent_norm else 0)
            out["routed_experts"] += m.num_experts * 3 * width * m.expert_dim
            out["shared_experts"] += _matrices(cfg, "shared") if m.num_shared_experts else 0
        if lora is not None and lora.enabled:
            out["lora"] += _lora_params(cfg, lora, mixer, ffn)
    if cfg.vision.enabled:
        out["vision"] = _vision_params(cfg)
    return {p: n for p, n in out.items() if n}


def active_params_by_part(cfg: ModelConfig, lora: LoRAConfig | None = None) -> dict[str, int]:
    """What one token multiplies through, by part: routed experts ``top_k / num_experts`` of themselves
    (exact: each expert is the same size), the embedding table only when tied, as the head's matmul."""
    out = params_by_part(cfg, lora)
    if "routed_experts" in out:
        out["routed_experts"] = out["routed_experts"] * cfg.moe.top_k // cfg.moe.num_experts
    table = out.pop("embedding")
    if cfg.tie_embeddings:
        out["lm_head_loss"] += table
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs per token

def kda_chunk_length(chunk_size: int, seq_len: int) -> int:
    """The chunk ``chunk_kda`` runs: ``min(chunk_size, T)`` rounded up to a power of two, at most
    ``kda_chunk.MAX_CHUNK``."""
    return min(1 << (min(chunk_size, seq_len) - 1).bit_length(), MAX_CHUNK)


def kda_dense_diagonal(cfg: ModelConfig, chunk: int) -> bool:
    """Whether the gate guarantees chunkwise KDA's dense diagonal sub-tiles (``kda_chunk.dense_ok``):
    the K3 gate ``lower_bound * sigmoid(.) > lower_bound`` sums to more than ``DENSE_MIN_SUM`` over a
    sub-tile when ``B_c * lower_bound >= DENSE_MIN_SUM``; a softplus gate guarantees nothing."""
    return cfg.kda.gate == "lower_bound" and min(SUBTILE, chunk) * cfg.kda.gate_lower_bound >= DENSE_MIN_SUM


def kda_flops_per_token(cfg: ModelConfig, seq_len: int, mode: Mode = "train") -> float:
    """Forward matmul FLOPs of one KDA head for one token (module docstring's table) over a sequence of
    ``seq_len`` tokens; ``decode``: one recurrent step."""
    k = v = cfg.kda.head_dim
    if mode == "decode":
        return 6.0 * k * v
    c = kda_chunk_length(cfg.kda.chunk_size, seq_len)
    bc = min(SUBTILE, c)
    doubling = max(math.ceil(math.log2(bc)), 1) - 1  # kda_chunk._doubling_inverse's squarings
    inverse = c * c + bc * c + 4 * doubling * bc * bc
    exact = 0 if kda_dense_diagonal(cfg, c) else 4 * bc * k
    return float(6 * c * k + 4 * c * v + 6 * k * v + inverse + exact)


def mla_flops_per_token(cfg: ModelConfig, seq_len: int, mode: Mode = "train") -> float:
    """Attention FLOPs of one MLA head for one token: causal over ``seq_len`` tokens (``T / 2`` keys on
    average), or with a cache (``decode``, ``prefill``) absorbed over its ``seq_len`` slots."""
    a = cfg.mla
    if mode in ("decode", "prefill"):
        return 2.0 * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * seq_len
    return 2.0 * (a.qk_head_dim + a.v_head_dim) * seq_len / 2


def mixing_flops_per_token(cfg: ModelConfig, seq_len: int, mode: Mode = "train") -> dict[str, float]:
    """Forward FLOPs per token of the token mixing beyond the weight matmuls, by part, all layers and
    heads (``train`` and ``forward`` alike: the forward over ``seq_len`` tokens)."""
    n_mla = sum(cfg.mixer(i) == "mla" for i in range(cfg.num_layers))
    n_kda = cfg.num_layers - n_mla
    return {"mla": n_mla * cfg.mla.num_heads * mla_flops_per_token(cfg, seq_len, mode),
            "kda": n_kda * cfg.kda.num_heads * kda_flops_per_token(cfg, seq_len, mode)}


# A LoRA training step over a frozen base: its weights' forward and the gradient of their inputs, no
# weight gradient (4 N instead of 6 N); the adapters train in full.
FROZEN_TRAIN_FACTOR = 2


def flops_per_token(cfg: ModelConfig, seq_len: int, mode: Mode = "train",
                    lora: LoRAConfig | None = None) -> dict[str, float]:
    """FLOPs per token by part of a training step (``3x`` the forward; ``2x`` for the frozen weights of
    a LoRA step, :data:`FROZEN_TRAIN_FACTOR`), a forward, or a decode step: ``2 N_active`` per part
    plus the token mixing (3x its forward in any training step: it has no weights)."""
    factor = STEP_FACTOR[mode]
    frozen = FROZEN_TRAIN_FACTOR if mode == "train" and lora is not None and lora.enabled else factor
    out = {p: 2.0 * (factor if p == "lora" else frozen) * n for p, n in active_params_by_part(cfg, lora).items()}
    for p, f in mixing_flops_per_token(cfg, seq_len, mode).items():
        if f:
            out[p] = out.get(p, 0.0) + factor * f
    return out


def model_flops(cfg: Config, tokens: int, mode: Mode = "train") -> float:
    """The model FLOPs a step's measured FLOPs are compared with: ``6 N_active tokens`` for training
    (``4 N_active + 6 N_lora`` for a LoRA step over a frozen base), ``2 N_active tokens`` otherwise."""
    lora = cfg.train.lora if mode == "train" and cfg.train.lora.enabled else None
    parts = active_params_by_part(cfg.model, lora)
    adapters = parts.pop("lora", 0)
    frozen = FROZEN_TRAIN_FACTOR if lora is not None else STEP_FACTOR[mode]
    return 2.0 * tokens * (frozen * sum(parts.values()) + STEP_FACTOR[mode] * adapters)


def step_flops(cfg: Config, tokens: int, seq_len: int, mode: Mode = "train") -> dict[str, float]:
    """All devices' analytic FLOPs per part of one step over ``tokens`` tokens (``tokens`` rows of one
    token for ``decode``, against a context of ``seq_len``); a training step with its Newton-Schulz."""
    lora = cfg.train.lora if mode == "train" else None
    out = {p: f * tokens for p, f in flops_per_token(cfg.model, seq_len, mode, lora).items()}
    ns = newton_schulz_flops(cfg) if mode == "train" else 0.0
    if ns:
        out["newton_schulz"] = ns
    return out


def step_read_bytes(cfg: Config, batch: int, seq_len: int, new_tokens: int) -> dict[str, float]:
    """The bytes a decode or prefill step must read from HBM, all devices (its lower bound of HBM traffic):
    ``batch`` rows of ``new_tokens`` tokens each against a cache of ``seq_len`` slots. Read off the abstract
    model's and cache's leaves, so storage formats count as stored (MXFP4 codes and scales, bf16 weights):

    - ``weights``: every weight but the routed experts and the input embedding, whole (a step multiplies
      each token through it);
    - ``embedding``: the looked-up rows only;
    - ``experts``: the routed experts the step's tokens select: per MoE layer, ``E (1 - (1 - k / E)^N)``
      distinct experts are expected among N tokens choosing ``k`` of ``E`` uniformly (Quantile Balancing
      keeps the loads near uniform);
    - ``cache``: the whole decoding cache (MLA's latent over every slot; KDA's states and conv tails)."""
    import jax  # noqa: PLC0415 - only this needs the model
    from flax import nnx  # noqa: PLC0415

    from k3jax.model import abstract_model  # noqa: PLC0415

    model = abstract_model(cfg.model)
    m = cfg.model.moe
    tokens = batch * new_tokens
    touched = 1.0 - (1.0 - m.top_k / m.num_experts) ** tokens if m.num_experts else 0.0
    out = {"weights": 0.0, "embedding": 0.0, "experts": 0.0}
    for var in jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        value = var.get_raw_value()
        size = math.prod(value.shape) * value.dtype.itemsize
        if "expert_in" in axes:
            out["experts"] += size * touched
        elif axes[-2:] == ("vocab", "embed"):
            out["embedding"] += size * min(1.0, tokens / value.shape[-2])
        else:
            out["weights"] += size
    cache = jax.eval_shape(lambda: model.init_cache(batch, seq_len))
    out["cache"] = float(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache)))
    return out


def newton_schulz_flops(cfg: Config) -> float:
    """FLOPs of the optimizer's Newton-Schulz iterations in one step, over all devices.

    Per Muon block with short side ``r`` and long side ``o``, each step forms ``X X^T`` and
    ``(b G + c G^2) X``: ``4 r^2 o + 2 r^3`` FLOPs. The blocks are the per-head / per-expert
    matrices of ``k3jax.optim`` (every batch axis, ``layers`` included, multiplies the count); none
    with ``train.optim.optimizer=adamw`` or in a LoRA run (AdamW on the adapters)."""
    if cfg.train.optim.optimizer != "muon" or cfg.train.lora.enabled:
        return 0.0
    from flax import nnx  # noqa: PLC0415 - only this needs the model and the optimizer's grouping

    from k3jax.model import abstract_model  # noqa: PLC0415
    from k3jax.optim import group_table, normalize_path  # noqa: PLC0415

    model = abstract_model(cfg.model)
    shapes = {normalize_path(p): v.get_raw_value().shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    total = 0.0
    for path, (_, dn, _) in group_table(model, per_head=cfg.train.optim.per_head_muon).items():
        if dn is None:
            continue
        shape = shapes[path]
        axes = lambda a: tuple(i % len(shape) for i in (a if isinstance(a, tuple) else (a,)))  # noqa: E731
        red, out = axes(dn.reduction_axis), axes(dn.output_axis)
        m, n = math.prod(shape[i] for i in red), math.prod(shape[i] for i in out)
        r, o = min(m, n), max(m, n)
        blocks = math.prod(shape) // (m * n)
        total += blocks * cfg.train.optim.ns_steps * (4 * r * r * o + 2 * r**3)
    return total


__all__ = ["FROZEN_TRAIN_FACTOR", "STEP_FACTOR", "active_params_by_part", "flops_per_token", "kda_chunk_length",
           "kda_dense_diagonal", "kda_flops_per_token", "mixing_flops_per_token", "mla_flops_per_token", "model_flops",
           "newton_schulz_flops", "params_by_part", "step_flops"]
