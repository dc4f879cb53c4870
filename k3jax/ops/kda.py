"""Kimi Delta Attention (KDA): gated delta rule with a per-channel decay (docs/kernels.md).

Layouts follow flash-linear-attention (fla):

- ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``;
- ``g``: ``[B, T, H, K]``, the per-step log-decay, already activated (``<= 0``);
- ``beta``: ``[B, T, H]``, already in ``(0, 1)``;
- state ``S``: ``[B, H, K, V]`` (rows are key channels).

Per head and token (fla's ``naive_recurrent_kda``)::

    S <- Diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

q and k are used as given: the caller L2-normalises them. All maths runs in float32 (float64
when the inputs are float64, which the gradient tests use); ``o`` comes back in ``v.dtype`` and
the state stays in the compute dtype.

Packed documents (``segment_ids [B, T]``): the state is reset to zero before every token whose
segment id differs from the previous token's; ``initial_state`` belongs to the segment of token 0.
Segments are therefore the runs between resets, so a recurring id after a different one starts a
new document. The chunk form applies this with masks rather than by splitting sequences, so
shapes stay static under ``jit``:

- the intra-chunk score matrices only link tokens of the same segment;
- only tokens before the chunk's first reset read the incoming state;
- only the chunk's last segment writes the outgoing state, and the incoming state is dropped
  when the chunk contains a reset.
"""

import jax
import jax.numpy as jnp

from k3jax.ops.kda_chunk import MAX_CHUNK, PRECISION, ChunkGates, chunk_scores, unit_lower_inverse



def kda_gate_lower_bound(z, A_log, dt_bias=None, lower_bound: float = -5.0):
    """K3 gate ``lower_bound * sigmoid(exp(A_log_h) * (z + dt_bias))``, in ``(lower_bound, 0)``.

    z ``[B, T, H, K]`` (raw gate projection), A_log ``[H]``, dt_bias ``[H, K]`` or None.
    Returns float32 (float64 for float64 inputs) ``[B, T, H, K]``.
    """
    z, a, b = _gate_inputs(z, A_log, dt_bias)
    return lower_bound * jax.nn.sigmoid(a * (z + b))


def kda_gate_softplus(z, A_log, dt_bias=None):
    """Kimi Linear gate ``-exp(A_log_h) * softplus(z + dt_bias)``, in ``(-inf, 0)``.

    z ``[B, T, H, K]``, A_log ``[H]``, dt_bias ``[H, K]`` or None. Returns float32 (float64 for
    float64 inputs) ``[B, T, H, K]``. ``jax.nn.softplus`` is ``logaddexp(x, 0)``: no overflow for
    large ``z``.
    """
    z, a, b = _gate_inputs(z, A_log, dt_bias)
    return -a * jax.nn.softplus(z + b)


def _gate_inputs(z, A_log, dt_bias):
    """Cast to the compute dtype; returns z, exp(A_log) ``[H, 1]`` and the bias ``[H, K]`` (or 0)."""
    if z.ndim != 4:
        raise ValueError(f"gate input z must be [B, T, H, K], got shape {z.shape}")
    H, K = z.shape[2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [H]=({H},), got {A_log.shape}")
    if dt_bias is not None and dt_bias.shape != (H, K):
        raise ValueError(f"dt_bias must have shape [H, K]=({H}, {K}), got {dt_bias.shape}")
    dtype = jnp.result_type(jnp.float32, z, A_log, *(() if dt_bias is None else (dt_bias,)))
    a = jnp.exp(A_log.astype(dtype))[:, None]
    b = 0.0 if dt_bias is None else dt_bias.astype(dtype)
    return z.astype(dtype), a, b


def check_inputs(q, k, v, g, beta, initial_state, segment_ids):
    """Validate shapes and dtypes; returns ``(B, T, H, K, V, compute_dtype)``."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {q.shape}, got {g.shape}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with [B, T, H]={(B, T, H)}, got {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]={(B, T, H)}, got {beta.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if T == 0:
        raise ValueError("sequence length T must be positive")
    V = v.shape[-1]
    dtype = jnp.result_type(jnp.float32, q, k, v, g, beta)
    if initial_state is not None and (initial_state.shape != (B, H, K, V) or initial_state.dtype != dtype):
        raise ValueError(
            f"initial_state must be {dtype} with shape [B, H, K, V]={(B, H, K, V)}, "
            f"got {initial_state.dtype} {initial_state.shape}"
        )
    if segment_ids is not None and (
        segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"segment_ids must be integer [B, T]={(B, T)}, got {segment_ids.dtype} {segment_ids.shape}"
        )
    return B, T, H, K, V, dtype


def segment_resets(segment_ids, B, T):
    """``[B, T]`` bool: the state is zeroed before token t (never before token 0)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0)))


def kda_step(state, q_t, k_t, v_t, g_t, beta_t, scale=None):
    """One recurrent KDA step (decode): returns ``(o_t, new_state)``.

    state ``[B, H, K, V]`` (float32, or float64 with float64 inputs), q_t/k_t/g_t ``[B, H, K]``,
    v_t ``[B, H, V]``, beta_t ``[B, H]``. o_t ``[B, H, V]`` in v_t's dtype. scale defaults to K**-0.5.
    """
    if state.ndim != 4 or state.dtype not in (jnp.float32, jnp.float64):
        raise ValueError(
            f"state must be a float32 (or float64) [B, H, K, V] array, got {state.dtype} {state.shape}"
        )
    B, H, K, V = state.shape
    for name, x, shape in (("q_t", q_t, (B, H, K)), ("k_t", k_t, (B, H, K)), ("g_t", g_t, (B, H, K)),
                           ("v_t", v_t, (B, H, V)), ("beta_t", beta_t, (B, H))):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} to match the state, got {x.shape}")
    dtype, out_dtype = state.dtype, v_t.dtype
    scale = K**-0.5 if scale is None else scale
    q_t, k_t, v_t, g_t, beta_t = (x.astype(dtype) for x in (q_t, k_t, v_t, g_t, beta_t))
    state = jnp.exp(g_t)[..., None] * state
    pred = jnp.einsum("bhk,bhkv->bhv", k_t, state, precision=PRECISION)
    state = state + jnp.einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - pred, precision=PRECISION)
    o_t = jnp.einsum("bhk,bhkv->bhv", scale * q_t, state, precision=PRECISION)
    return o_t.astype(out_dtype), state


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, segment_ids=None):
    """Token-by-token KDA (a ``lax.scan`` of ``kda_step``); the reference for ``chunk_kda``.

    Shapes as in the module docstring. Returns ``(o [B, T, H, V] in v.dtype, final_state
    [B, H, K, V] or None)``.
    """
    B, T, H, K, V, dtype = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    scale = K**-0.5 if scale is None else scale
    state = jnp.zeros((B, H, K, V), dtype) if initial_state is None else initial_state
    resets = segment_resets(segment_ids, B, T)

    def step(state, xs):
        reset, q_t, k_t, v_t, g_t, beta_t = xs
        state = jnp.where(reset[:, None, None, None], 0.0, state)
        o_t, state = kda_step(state, q_t, k_t, v_t, g_t, beta_t, scale)
        return state, o_t

    time_major = [jnp.moveaxis(x, 1, 0) for x in (resets, q, k, v, g, beta)]
    state, o = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(o, 0, 1), (state if output_final_state else None)


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64, segment_ids=None
):
    """Chunkwise-parallel KDA (docs/kernels.md), equal to ``recurrent_kda`` up to rounding.

    Shapes as in the module docstring; any T works (the tail is padded with ``g = beta = q = k = v
    = 0``, which leaves the state unchanged, and sliced off). The chunk is ``min(chunk_size, T)``
    rounded up to a power of two, at most ``kda_chunk.MAX_CHUNK``. Returns ``(o [B, T, H, V] in
    v.dtype, final_state [B, H, K, V] or None)``.

    Per chunk of C tokens, with G the chunk-local cumsum of g, Gamma = exp(G), S the incoming state:

    1. ``A_kk[i, j] = sum_d k_id k_jd exp(G_id - G_jd)`` and ``A_qk`` likewise with q, for j <= i and the
       same segment (``kda_chunk.chunk_scores``: anchored 16-token sub-tiles, batched matmuls);
       ``L = Diag(beta) A_kk`` below the diagonal;
    2. ``[U | W] = (I + L)^-1 Diag(beta) [V | Gamma k]`` (UT transform, ``kda_chunk.unit_lower_inverse``);
    3. ``delta = U - W S`` (what each token writes);
    4. ``S <- Diag(exp(G_last)) S + (exp(G_last - G) k)^T delta``;
    5. ``o = (q Gamma) S + A_qk delta``.

    Steps 1, 2 and 5 are batched over all chunks; only 3 and 4 run in a ``lax.scan`` over chunks, which
    hands back the state entering every chunk and delta for step 5. Every exponent is ``<= 0`` or
    bounded (masked ones are replaced before ``exp``, so gradients stay finite), hence any ``g <= 0`` is
    safe (e.g. a softplus gate at -100; g is floored at ``kda_chunk.G_FLOOR``), and each is accurate to
    ``eps * |exponent|`` however large G grows. With segments, step 1 only links tokens of the same
    segment, ``Gamma k`` and ``q Gamma`` are zeroed from the chunk's first reset on, and step 4 keeps
    only the last segment (and drops ``Diag(exp(G_last)) S`` after a reset).

    Memory: no ``C x C x K`` tensor; the largest intermediates are the anchored key factors, ``C / 16``
    times the size of k (docs/kernels.md, "The XLA op").
    """
    B, T, H, K, V, dtype = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    C = min(1 << (min(chunk_size, T) - 1).bit_length(), MAX_CHUNK)
    N = -(-T // C)

    def to_chunks(x):
        """``[B, T, H, ...]`` -> ``[B, N, H, C, ...]``, zero-padding the tail."""
        x = jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 2, 3)

    q, k, v, g, beta = (to_chunks(x.astype(dtype)) for x in (q, k, v, g, beta))
    q = q * scale
    # resets seen so far inside the chunk, [B, N, 1, C]: equal counts <=> same segment
    n_resets = to_chunks(segment_resets(segment_ids, B, T)[:, :, None].astype(jnp.int32)).cumsum(axis=-1)
    reads_state = (n_resets == 0)[..., None]  # [B, N, 1, C, 1]
    in_last_segment = (n_resets == n_resets[..., -1:])[..., None]  # [B, N, 1, C, 1]
    same_segment = n_resets[..., :, None] == n_resets[..., None, :]  # [B, N, 1, C(i), C(j)]
    causal = jnp.tril(jnp.ones((C, C), bool))

    A_qk, A_kk = chunk_scores((q, k), k, g)  # [B, N, H, C(i), C(j)], zero above the diagonal
    A_qk = jnp.where(same_segment & causal, A_qk, 0.0)
    L = beta[..., :, None] * jnp.where(same_segment & causal & ~jnp.eye(C, dtype=bool), A_kk, 0.0)

    per_token = lambda x: x.reshape(B, N, H, C, -1)
    gates = ChunkGates.from_gate(g)  # cumsums per 16-token sub-tile, [B, N, H, C/16, 16, K]
    G, G_last = gates.G, gates.G_last
    gamma = per_token(jnp.exp(G[0] + G[1]))  # [B, N, H, C, K], <= 1
    rhs = beta[..., None] * jnp.concatenate([v, jnp.where(reads_state, gamma * k, 0.0)], axis=-1)
    UW = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(L), rhs, precision=PRECISION)  # [.., C, V + K]
    U, W = UW[..., :V], UW[..., V:]  # [B, N, H, C, V], [B, N, H, C, K]
    q_gamma = jnp.where(reads_state, q * gamma, 0.0)  # [B, N, H, C, K]
    decay_to_end = per_token(jnp.exp((G_last[0] - G[0]) + (G_last[1] - G[1])))  # [B, N, H, C, K], <= 1
    k_out = jnp.where(in_last_segment, decay_to_end * k, 0.0)
    state_decay = jnp.where(reads_state[..., -1, :], gamma[..., -1, :], 0.0)  # [B, N, H, K]

    def chunk_step(S, xs):
        U, W, k_out, state_decay = xs
        delta = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=PRECISION)
        S_next = state_decay[..., None] * S + jnp.einsum("bhck,bhcv->bhkv", k_out, delta, precision=PRECISION)
        return S_next, (S, delta)

    S0 = jnp.zeros((B, H, K, V), dtype) if initial_state is None else initial_state
    S, (S_in, delta) = jax.lax.scan(chunk_step, S0, [jnp.moveaxis(x, 1, 0) for x in (U, W, k_out, state_decay)])
    # the outputs of all chunks at once: o = (q Gamma) S + A_qk delta
    o = (jnp.einsum("bnhck,nbhkv->bnhcv", q_gamma, S_in, precision=PRECISION)
         + jnp.einsum("bnhij,nbhjv->bnhiv", A_qk, delta, precision=PRECISION))
    o = jnp.moveaxis(o, 3, 2).reshape(B, N * C, H, V)[:, :T]
    return o.astype(out_dtype), (S if output_final_state else None)
