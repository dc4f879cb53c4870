"""Attention over a cache whose slots are split over devices (k3jax/parallel/cache_attention.py).

- ``chunked_attention_with_lse`` against the plain masked softmax: its output, its log-sum-exp (-inf
  and zeros for a query that sees nothing), partials over disjoint key sets combining into the whole.
- The layout rule (split keys / split queries) on K3's and a decode step's sizes.
- On 8 fake CPU devices (``tests/children/slot_split_cache.py``, a subprocess: the device count is set
  before JAX starts): both layouts equal the single-device op, with rows and shards that see nothing, and
  the slot write equals ``dynamic_update_slice`` (chunks at, across and over shard boundaries); a 2-layer MLA model decodes (batch 1
  and 2, a left-padded row) and prefills a chunk into a partly filled 4096-slot cache split 8 (or 4)
  ways with the single-device logits and cache; and the compiled programs' collectives move the
  partials or the cache once, where the GSPMD-partitioned loops move the cache per key block (and its
  write of a chunk gathers the whole cache).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_devices import run_child
from k3jax.ops import attention as attn_ops
from k3jax.parallel.cache_attention import choose_split

pytestmark = pytest.mark.usefixtures("fast_xla")

B, H, D, DV = 2, 3, 8, 5


def _masked_scores(q, k, mask, scale):
    """Plain float32 scores ``[B, H, T, S]`` of a shared key ``[B, S, 1, D]``, -inf where masked."""
    scores = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0]) * scale
    return jnp.where(mask[:, None], scores, -jnp.inf)


@pytest.mark.parametrize("t,s,q_chunk,kv_chunk", [(1, 37, 4, 8), (13, 29, 4, 6), (9, 9, 512, 1024)])
def test_lse_matches_plain_reference(t, s, q_chunk, kv_chunk):
    """Odd shapes over several blocks (and one block): o equals ``attention`` and ``chunked_attention``;
    lse equals logsumexp of the visible scores; a row with no visible key gets zeros and -inf."""
    kq, kk = jax.random.split(jax.random.key(t * s))
    q = jax.random.normal(kq, (B, t, H, D))
    k = jax.random.normal(kk, (B, s, 1, D))
    v = k[..., :DV]
    q_index = jnp.broadcast_to(s - t + jnp.arange(t, dtype=jnp.int32), (B, t))
    kv_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
    kv_valid = jnp.stack([jnp.arange(s) >= 3, jnp.zeros((s,), bool)])  # row 1 sees nothing
    fn = jax.jit(attn_ops.chunked_attention_with_lse, static_argnames=("scale", "q_chunk", "kv_chunk"))
    o, lse = fn(q, k, v, q_index, kv_index, kv_valid=kv_valid, scale=0.4, q_chunk=q_chunk, kv_chunk=kv_chunk)
    assert o.dtype == jnp.float32 and o.shape == (B, t, H, DV) and lse.shape == (B, t, H)
    mask = attn_ops.attention_mask(q_index, kv_index, kv_valid=kv_valid)
    np.testing.assert_allclose(o, attn_ops.attention(q, k, v, mask, scale=0.4), rtol=1e-5, atol=1e-6)
    plain = attn_ops.chunked_attention(q, k, v, q_index, kv_index, kv_valid=kv_valid, scale=0.4, q_chunk=q_chunk,
                                       kv_chunk=kv_chunk)
    np.testing.assert_array_equal(o, plain)  # the same values, chunked_attention's output unchanged
    want_lse = jax.nn.logsumexp(_masked_scores(q, k, mask, 0.4), axis=-1)  # [B, H, T]
    np.testing.assert_allclose(lse[0], jnp.moveaxis(want_lse[0], 0, 1), rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(lse[1])) and not np.any(o[1])


def test_partials_over_disjoint_keys_combine_into_the_whole():
    """The split-keys combine: attention over two halves of the keys, weighted by exp(lse_i - lse), is
    the attention over all of them (half 2 is wholly in the future of the first queries)."""
    t, s = 6, 20
    kq, kk = jax.random.split(jax.random.key(3))
    q = jax.random.normal(kq, (B, t, H, D))
    k = jax.random.normal(kk, (B, s, 1, D))
    v = k[..., :DV]
    q_index = jnp.broadcast_to(jnp.asarray([0, 2, 9, 10, 15, 19], jnp.int32), (B, t))
    kv_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
    parts = [attn_ops.chunked_attention_with_lse(q, k[:, sl], v[:, sl], q_index, kv_index[:, sl], scale=0.5,
                                                 q_chunk=4, kv_chunk=3)
             for sl in (slice(0, 10), slice(10, s))]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    o = sum(p[0] * jnp.exp(p[1] - lse)[..., None] for p in parts)
    whole = attn_ops.attention(q, k, v, attn_ops.attention_mask(q_index, kv_index), scale=0.5)
    np.testing.assert_allclose(o, whole, rtol=1e-5, atol=1e-6)
    assert np.all(np.isneginf(parts[1][1][:, :2]))  # the first queries see nothing of half 2


def test_layout_rule():
    """Decode steps and short chunks split keys; K3's 16K-token chunk into 1M slots splits queries
    (1.2 GB of latent gathered against 8.3 GB of queries and partials); queries that do not divide over
    the shards always split keys."""
    k3 = dict(slots=1 << 20, heads=96, key_dim=576, value_dim=512, shards=128, q_itemsize=2, kv_itemsize=2)
    assert choose_split(queries=1, **k3) == "keys"
    assert choose_split(queries=16384, **k3) == "queries"
    assert choose_split(queries=16384 + 8, **k3) == "keys"  # not a multiple of 128
    tiny = dict(slots=65536, heads=4, key_dim=40, value_dim=32, shards=8, q_itemsize=4, kv_itemsize=4)
    assert choose_split(queries=2048, **tiny) == "keys"  # 10.5 MB of cache against 3.5 MB of partials
    assert choose_split(queries=8192, **tiny) == "queries"


@pytest.mark.slow
def test_slot_split_cache_attention_on_8_devices():
    print(run_child("slot_split_cache"))
