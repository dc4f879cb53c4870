"""Block Attention Residuals (docs/design.md "Block Attention Residuals").

Each sublayer mixes a list of source tensors with a softmax over depth, scored by a learned
pseudo-query against the RMS-normalised sources: ``score_j = (gamma * w) . v_j / rms(v_j)``,
``h = sum_j softmax_j(score) v_j`` (float32). The sources are the embedding, the completed block
sums (the *bank*) and the running partial sum of the current block.

The bank is a fixed-size buffer with a count of valid rows (``AttnResConfig.num_slots``), so a
scanned group of layers can close a block under a traced predicate (``AttnResConfig.closes_block``)
and the compiled graph does not depend on where blocks close.

A closing layer does not write the bank: it sets the block sum aside as ``pending`` (a source in its
bank row all the same), and :func:`flush` writes it between layers: once per scanned group, and
after an unrolled layer that closed a block. The bank
a group's layers read is then one value, which the layers' checkpoints save once per group instead
of once per layer (full K3 on v5p-1024: 3 of 4 saved banks, 15.5 GB per device, go; docs/scale.md).
Nothing here depends on other positions, so decoding needs no AttnRes cache: every token carries its
own bank through the layers.

:class:`ResidualStream` is the whole protocol as the model runs it (and the plain pre-norm residual
when AttnRes is off): the model calls it and holds no AttnRes rule of its own.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.initializers import constant


class AttnResState(NamedTuple):
    bank: jax.Array  # [S, B, T, d] completed block sums in rows [0, stored); row 0 is the embedding
    num_blocks: jax.Array  # int32 scalar: completed blocks (the stored rows, plus the pending one)
    partial: jax.Array  # [B, T, d] running sum of the current block
    pending: jax.Array  # [B, T, d] the block completed since the last flush (when num_blocks > stored)
    stored: jax.Array  # int32 scalar: bank rows written


def init_state(embedding: jax.Array, num_slots: int) -> AttnResState:
    """The state before layer 0: an empty bank and the embedding as the partial sum."""
    bank = jnp.zeros((num_slots,) + embedding.shape, embedding.dtype)
    zero = jnp.zeros((), jnp.int32)
    return AttnResState(bank, zero, embedding, jnp.zeros_like(embedding), zero)


def completed_blocks(state: AttnResState) -> jax.Array:
    """The bank with the pending block in its row: ``[S, B, T, d]``, rows ``[0, num_blocks)`` valid."""
    n = jnp.minimum(state.stored, state.bank.shape[0] - 1)
    row = jnp.where(state.num_blocks > state.stored, state.pending, state.bank[n])
    return jax.lax.dynamic_update_index_in_dim(state.bank, row, n, axis=0)


def sources(state: AttnResState) -> tuple[jax.Array, jax.Array]:
    """``completed blocks + [partial]`` as ``[S+1, B, T, d]`` and its validity mask ``[S+1]``."""
    values = jnp.concatenate([completed_blocks(state), state.partial[None]], axis=0)
    valid = jnp.append(jnp.arange(state.bank.shape[0]) < state.num_blocks, True)
    return values, valid


def close_block(state: AttnResState, close) -> AttnResState:
    """If ``close``: the partial sum becomes the pending block and an empty partial starts. The bank is
    left as it is; the state must have no pending block (:func:`flush` first)."""
    pending = jnp.where(close, state.partial, state.pending)
    partial = jnp.where(close, jnp.zeros_like(state.partial), state.partial)
    return state._replace(num_blocks=state.num_blocks + jnp.asarray(close, jnp.int32), partial=partial,
                          pending=pending)


def flush(state: AttnResState) -> AttnResState:
    """Write the pending block, if any, into its bank row."""
    return state._replace(bank=completed_blocks(state), stored=state.num_blocks)


def add(state: AttnResState, y: jax.Array) -> AttnResState:
    return state._replace(partial=state.partial + y.astype(state.partial.dtype))


def attn_res_mix(values: jax.Array, valid: jax.Array, query: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """Depth softmax. values ``[S, B, T, d]``, valid ``[S]``, query and gain ``[d]`` -> ``[B, T, d]``."""
    vf = values.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(vf), axis=-1) + eps)  # [S, B, T]
    cw = query.astype(jnp.float32) * gain.astype(jnp.float32)
    scores = jnp.einsum("sbtd,d->sbt", vf, cw) * inv_rms
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=0)
    return jnp.einsum("sbt,sbtd->btd", p, vf).astype(values.dtype)


class AttnResMix(nnx.Module):
    """One sublayer's pseudo-query ``w`` (zero-initialised: a uniform average at init) and gain."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.query = constant(0.0, (dim,), ("embed",), param_dtype)
        self.norm = constant(1.0, (dim,), ("embed",), param_dtype)

    def __call__(self, state: AttnResState) -> jax.Array:
        values, valid = sources(state)
        return attn_res_mix(values, valid, self.query[...], self.norm[...], self.eps)


@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """The residual protocol of one decoder stack: what each sublayer reads, when a block closes, when
    the bank is written and what the final readout mixes. With ``attn_res`` off it is the plain
    pre-norm residual (the carry is the stream ``[B, T, d]``); with it on the carry is an
    :class:`AttnResState` and the ``mix`` arguments are the sublayers' :class:`AttnResMix`.

    Per decoder layer: ``mixer_input`` (read, then close a block at a closing layer), the mixer,
    ``ffn_input`` (add its output, read), the FFN, ``layer_output`` (add). Between layers:
    ``after_unrolled_layer`` or ``after_group_layer`` (write a pending block into the bank)."""

    attn_res: bool
    block_size: int  # decoder layers per AttnRes block
    num_layers: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> ResidualStream:
        return cls(cfg.attn_res.enabled, cfg.attn_res.block_size, cfg.num_layers)

    def closes_block(self, layer):
        """Whether decoder layer ``layer`` (an int, or an int array traced inside the scan) first pushes the
        running partial sum into the bank: layers 0, block_size, 2 block_size, ... (at layer 0 the partial
        is the embedding)."""
        return layer % self.block_size == 0

    @property
    def num_slots(self) -> int:
        """Bank rows the stack fills: one per closing layer (the embedding included). The final readout
        mixes these and the running partial: ``num_slots + 1`` sources."""
        return -(-self.num_layers // self.block_size)

    def flushes_every_layer(self, group_size: int) -> bool:
        """Whether a scanned group of ``group_size`` layers writes the bank after every layer: when blocks
        are shorter than a group, which may then close more than one. Otherwise a group closes at most
        one block, and its layers share the bank they read, written once at the group's end."""
        return self.block_size < group_size

    def start(self, embedding: jax.Array):
        """The carry before layer 0. embedding ``[B, T, d]``."""
        return init_state(embedding, self.num_slots) if self.attn_res else embedding

    def mixer_input(self, carry, layer, mix: AttnResMix | None):
        """-> (the mixer's input ``[B, T, d]``, carry). ``layer``: this layer's index (traced in the scan)."""
        if not self.attn_res:
            return carry, carry
        with jax.named_scope("attn_res"):
            return mix(carry), close_block(carry, self.closes_block(layer))

    def ffn_input(self, carry, y: jax.Array, mix: AttnResMix | None):
        """The mixer's output ``y`` added -> (the FFN's input ``[B, T, d]``, carry)."""
        if not self.attn_res:
            h = carry + y.astype(carry.dtype)
            return h, h
        with jax.named_scope("attn_res"):
            state = add(carry, y)
            return mix(state), state

    def layer_output(self, carry, y: jax.Array):
        """The FFN's output ``y`` added: the carry out of the layer."""
        if not self.attn_res:
            return carry + y.astype(carry.dtype)
        with jax.named_scope("attn_res"):
            return add(carry, y)

    def after_unrolled_layer(self, carry, layer: int):
        """After an unrolled layer: it knows whether it closed a block, so a closed one is written now."""
        return flush(carry) if self.attn_res and self.closes_block(layer) else carry

    def after_group_layer(self, carry, slot: int, group_size: int):
        """After slot ``slot`` of a scanned group of ``group_size`` layers (:meth:`flushes_every_layer`)."""
        if self.attn_res and (slot == group_size - 1 or self.flushes_every_layer(group_size)):
            return flush(carry)
        return carry

    def without_bank(self, out, carry):
        """A layer's output carry with the bank taken out: a layer reads the bank but never writes it, so a
        layer checkpoint gets the bank as an input, not an output, and every layer of a scanned group
        checkpoints the same bank value (the scan saves it once per group, not per layer)."""
        if not self.attn_res:
            return out
        assert out.bank is carry.bank, "a decoder layer wrote the AttnRes bank (flush does that)"
        return out._replace(bank=None)

    def with_bank(self, out, carry):
        """The inverse of :meth:`without_bank`: the input carry's bank put back."""
        return out._replace(bank=carry.bank) if self.attn_res else out

    def readout(self, carry, mix: AttnResMix | None) -> jax.Array:
        """The final hidden state ``[B, T, d]`` before the final norm."""
        if not self.attn_res:
            return carry
        with jax.named_scope("attn_res"):
            return mix(carry)
