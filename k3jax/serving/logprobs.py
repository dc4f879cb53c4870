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


def token_logprobs(logits: jax.Array, targets: jax.Array, k: int, wanted: jax.Array):
    """logits ``[..., V]``, targets ``[...]`` int -> (the targets' log-probabilities ``[...]``, the
    top-``k`` log-probabilities ``[..., k]`` and their ids ``[..., k]`` int32), all float32 from
    ``log_softmax(logits)``. ``wanted``: a traced bool; when false the work is skipped (zeros come
    back), so a step without a request for log-probabilities pays nothing for them."""
    shape = targets.shape

    def compute(logits, targets):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        own = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
        top, ids = jax.lax.top_k(logp, k)
        return own, top, ids.astype(jnp.int32)

    def skip(logits, targets):
        return (jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.float32),
                jnp.zeros((*shape, k), jnp.int32))

    return jax.lax.cond(wanted, compute, skip, logits, targets)
