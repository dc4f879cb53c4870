"""Depthwise causal 1-D convolution over time: KDA's short convolution (width 4 in K3)."""

import jax.numpy as jnp


def causal_conv1d(x, weight, *, segment_ids=None, initial_state=None, output_final_state=False):
    """``y_t = sum_{w=0}^{W-1} weight[w] * x_{t-(W-1)+w}``, per channel, no bias, no activation.

    x ``[B, T, C]``, weight ``[W, C]``: ``weight[W-1]`` multiplies the current token, i.e. torch's
    ``Conv1d(groups=C, padding=W-1)`` weight ``[C, 1, W]`` transposed, output sliced to the first T.

    - segment_ids ``[B, T]`` int (packed documents): inputs from another segment count as zero, so
      the window restarts at each token whose id differs from the previous token's.
    - initial_state ``[B, W-1, C]`` (x's dtype): the W-1 inputs before token 0 (decode), zeros if
      None; they belong to the segment of token 0.
    - final_state ``[B, W-1, C]``: the last W-1 inputs (taken from initial_state / zeros when
      T < W-1), with entries outside the last token's segment zeroed, so that a following call
      continuing that segment sees exactly what a single call would have seen.

    Products and sums run in float32; y is returned in x's dtype.
    Returns ``(y [B, T, C], final_state or None)``.
    """
    if x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating [B, T, C] array, got {x.dtype} {x.shape}")
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[1] != C or weight.shape[0] < 1:
        raise ValueError(f"weight must be [W, C] with W >= 1 and C={C}, got {weight.shape}")
    W = weight.shape[0]
    if initial_state is None:
        initial_state = jnp.zeros((B, W - 1, C), x.dtype)
    elif initial_state.shape != (B, W - 1, C) or initial_state.dtype != x.dtype:
        raise ValueError(
            f"initial_state must be {x.dtype} [B, W-1, C]={(B, W - 1, C)}, "
            f"got {initial_state.dtype} {initial_state.shape}"
        )
    if segment_ids is not None and (
        segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"segment_ids must be integer [B, T]={(B, T)}, got {segment_ids.dtype} {segment_ids.shape}"
        )

    x_ext = jnp.concatenate([initial_state, x], axis=1)  # [B, W-1+T, C]
    # segment index of every position: the number of resets up to it (the state is segment 0),
    # so equal indices <=> same document, even if an id recurs later
    if segment_ids is None:
        seg_ext = jnp.zeros((B, W - 1 + T), jnp.int32)
    else:
        resets = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (W, 0)))
        seg_ext = jnp.cumsum(resets.astype(jnp.int32), axis=1)
    seg = seg_ext[:, W - 1 :]  # [B, T]

    x32 = x_ext.astype(jnp.float32)
    w32 = weight.astype(jnp.float32)
    y = jnp.zeros((B, T, C), jnp.float32)
    for w in range(W):  # W is tiny (4): one shifted multiply-add per tap
        visible = (seg_ext[:, w : w + T] == seg)[..., None]
        y = y + jnp.where(visible, x32[:, w : w + T], 0.0) * w32[w]
    final_state = None
    if output_final_state:
        tail_visible = (seg_ext[:, T:] == seg_ext[:, -1:])[..., None]
        final_state = jnp.where(tail_visible, x_ext[:, T:], jnp.zeros((), x.dtype))
    return y.astype(x.dtype), final_state
