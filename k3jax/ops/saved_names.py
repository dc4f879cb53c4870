"""Names of the intermediate values a selective remat policy keeps (``jax.ad_checkpoint.checkpoint_name``).

Each name is attached where the value is made, once for every implementation of that step (the
pure-JAX op, the Pallas kernels, the expert- and sequence-parallel paths), and ``model.remat =
selective`` (``k3jax/model.py``) saves exactly these: the backward pass then recomputes a layer's
projections and elementwise work but none of the matmuls behind these values.
"""

# The gate and up projections entering every GLU (routed experts, shared experts, dense FFN):
# ``[rows, F]`` each. With them saved, the backward pass runs no expert matmul of the forward again.
GLU_INPUTS = "glu_inputs"
# The routed experts' per-pair outputs ``[N, k, L]`` before the weighted sum (the routing weights'
# gradient needs them; saved, the down projection and the return exchange are not recomputed).
EXPERT_PAIR_OUTPUTS = "expert_pair_outputs"
# A token mixer's core output before its output norm / gate: MLA's attention ``[B, T, H, v]``, KDA's
# chunked recurrence ``[B, T, H, V]``. Small (one value per head channel and token) and the costliest
# to recompute: the attention's scores or the KDA chunk pass.
MIXER_OUTPUTS = "mixer_outputs"

# The routed experts' weighted sum ``u [N, L]`` (float32) entering Stable LatentMoE's latent norm. The
# pairs are weighted before their down projection (k3jax/parallel/expert.py), so the norm's backward is
# the only use of u that a layer's backward has: kept, the down projections and the return exchange are
# not recomputed (one value per latent channel and token: a sixteenth of the pairs' outputs for K3).
EXPERT_SUMS = "expert_sums"

# A token mixer's output after its output projection ``[B, T, d]``: the layer's FFN input (its norm, or
# Block AttnRes's mix) reads it, so a rematerialised layer that does not keep it runs the projection again.
MIXER_PROJECTED = "mixer_projected"

# MLA's latent attention's output blocks and their log-sum-exp (``k3jax.ops.attention``, inside its custom
# VJP's forward: ``[B, T, H, v]`` and ``[B, T, H]`` float32), which its backward reads beside its inputs. The
# mixer's core output alone does not spare the attention: without these the backward runs its forward
# (every score, every key block's expansion) again to rebuild them.
ATTENTION_RESIDUALS = "attention_residuals"
# KDA's q, k and v projections before the short conv ``[B, T, H, K]`` (the conv's and the chunk pass's
# backward read them), and both mixers' output-gate projections ``x W_g`` ``[B, T, H, v]``: the
# projections of the layer input a rematerialised mixer otherwise runs again, ``d`` FLOPs per byte kept.
MIXER_PROJECTIONS = "mixer_projections"

SELECTIVE = (GLU_INPUTS, EXPERT_PAIR_OUTPUTS, MIXER_OUTPUTS, EXPERT_SUMS)
# ``model.remat = outputs``: per-layer remat keeping only each sublayer's outputs, a few values per token
# and layer (K3 on v5p-1024: 59 MB per layer and device), the ones whose recomputation costs the most
# per byte: the output projections, the routed experts' down projections and their return exchange.
SUBLAYER_OUTPUTS = (MIXER_PROJECTED, EXPERT_SUMS)
# ``model.remat = outputs_offload``: SUBLAYER_OUTPUTS and MLA's attention residuals on the device (K3 on
# v5p-1024: 51 MB per MLA layer and device), the mixers' projections of the layer input moved to host
# memory in the forward pass and back for the backward (50 MB each per layer and device: 4 per KDA layer,
# 1 per MLA layer; 15 GB per step for K3, more than the HBM spares).
OUTPUTS_AND_ATTENTION = (*SUBLAYER_OUTPUTS, ATTENTION_RESIDUALS)
HOST_SAVED = (MIXER_PROJECTIONS,)
