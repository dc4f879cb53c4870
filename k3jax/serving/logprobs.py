"""Log-probabilities of tokens under the model, for OpenAI's ``logprobs`` / ``echo`` and for scoring
(lm-evaluation-harness): the log-softmax of the logits in float32, before temperature and top-p,
computed on the device inside the engine's prefill and decode steps. Only the token's own
log-probability and the top ``k`` (values and ids) leave the device, never the full-vocabulary row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# OpenAI's limit on ``logprobs`` (completions) and ``top_logprobs`` (chat): the static top-k of the steps.
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the ``len(top_ids)`` most likely tokens at its position
    (most likely first), all under the model's distribution at that position."""
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def read_logprobs(own, top, ids, k: int) -> TokenLogprobs:
    """A token's log-probability and its position's first ``k`` alternatives, from one position's host
    arrays of ``token_logprobs`` (own: a scalar, top / ids: ``[MAX_LOGPROBS]``)."""
    return TokenLogprobs(float(own), tuple(int(i) for i in ids[:k]), tuple(float(v) for v in top[:k]))


# Vocabulary columns per pass of the chunked log-softmax: an echo request's prefill piece scores every
# position, and a float32 [rows, chunk, 163840] log-softmax (with its exponentials) is several times the
# logits; a pass holds [rows, chunk, VOCAB_CHUNK].
VOCAB_CHUNK = 16384


def token_logprobs(logits: jax.Array, targets: jax.Array, k: int, wanted: jax.Array, *,
                   vocab_chunk: int = VOCAB_CHUNK):
    """logits ``[..., V]``, targets ``[...]`` int -> (the targets' log-probabilities ``[...]``, the
    top-``k`` log-probabilities ``[..., k]`` and their ids ``[..., k]`` int32), all float32 from
    ``log_softmax(logits)``. ``wanted``: a traced bool; when false the work is skipped (zeros come
    back), so a step without a request for log-probabilities pays nothing for them. A vocabulary wider
    than ``vocab_chunk`` is read ``vocab_chunk`` columns at a time (:func:`chunked_logprobs`)."""
    shape = targets.shape

    def compute(logits, targets):
        if logits.shape[-1] > vocab_chunk:
            return chunked_logprobs(logits, targets, k, vocab_chunk)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        own = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
        top, ids = jax.lax.top_k(logp, k)
        return own, top, ids.astype(jnp.int32)

    def skip(logits, targets):
        return (jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.float32),
                jnp.zeros((*shape, k), jnp.int32))

    return jax.lax.cond(wanted, compute, skip, logits, targets)


def chunked_logprobs(logits: jax.Array, targets: jax.Array, k: int, chunk: int):
    """:func:`token_logprobs`' values, one pass over ``chunk`` vocabulary columns at a time: a running
    max and rescaled sum of exponentials (the log-sum-exp), the target's logit picked up in its pass, and
    the top ``k`` merged pass by pass (earlier ids first among ties, as ``lax.top_k`` over the whole row).
    The last pass starts at ``V - chunk`` and ignores the columns an earlier pass read."""
    vocab = logits.shape[-1]
    lead = targets.shape
    targets = targets.astype(jnp.int32)

    def one_pass(carry, i):
        high, total, own, top, ids = carry
        start = jnp.minimum(i * chunk, vocab - chunk)
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        x = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=-1).astype(jnp.float32)
        x = jnp.where(cols >= i * chunk, x, -jnp.inf)  # read by the previous pass
        new_high = jnp.maximum(high, jnp.max(x, axis=-1))
        total = total * jnp.exp(high - new_high) + jnp.sum(jnp.exp(x - new_high[..., None]), axis=-1)
        here = (targets >= i * chunk) & (targets < start + chunk)
        picked = jnp.take_along_axis(x, jnp.clip(targets - start, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        own = jnp.where(here, picked, own)
        top, pos = jax.lax.top_k(jnp.concatenate([top, x], axis=-1), k)
        ids = jnp.take_along_axis(jnp.concatenate([ids, jnp.broadcast_to(cols, x.shape)], axis=-1), pos, axis=-1)
        return (new_high, total, own, top, ids), None

    start = (jnp.full(lead, -jnp.inf), jnp.zeros(lead), jnp.zeros(lead), jnp.full((*lead, k), -jnp.inf),
             jnp.zeros((*lead, k), jnp.int32))
    (high, total, own, top, ids), _ = jax.lax.scan(one_pass, start, jnp.arange(-(-vocab // chunk)))
    lse = high + jnp.log(total)
    return own - lse, top - lse[..., None], ids
