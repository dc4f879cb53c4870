"""The serving engine's device programs (``k3jax.serving.engine`` runs them): the prefill of a piece of
prompts into a small cache, the insert of a prefilled row into the pool, the move of the pool's slots
(``realign``), the decode steps of the pool's first 1, 2, 4, ... and ``max_batch`` rows, and the prefix
cache's block copies. All have fixed shapes (pool, chunk, row index and shifts are traced), so each
compiles once (``Engine.warmup``), whatever requests come and go; on a mesh their output layouts are
fixed too, so a step's outputs are the next step's inputs without a new signature."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.cache import first_rows, init_cache, keep_rows, pack_row, put_first_rows, read_block, shift_slots, \
    write_block, write_row
from k3jax.serving.logprobs import MAX_LOGPROBS, token_logprobs
from k3jax.serving.sampling import sample_rows
from k3jax.sharding import Layout, cache_shardings


def _routes(stats, shape) -> jax.Array:
    """The forward's recorded routes ``[*shape, M, k]`` (``ForwardStats.routes``), or an empty ``[*shape, 0, 0]``
    when it recorded none: every program returns an array there, so its outputs have one structure."""
    return stats.routes if stats.routes is not None else jnp.zeros((*shape, 0, 0), jnp.int32)


def sampled_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
    """The log-probability ``[R]`` of each row's sampled token under the distribution it was sampled from:
    ``log_softmax(logits / temperature)`` (logits ``[R, V]``, tokens ``[R]``, temperature ``[R]``; greedy rows,
    temperature 0, at the raw logits). Top-p is not applied: it truncates the sampler, not the policy the
    trainer recomputes."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]


def decode_program(graphdef, *, record_routes: bool = False):
    """The engine's decode step as a function of its arrays (the engine jits it per row count; ``python -m
    k3jax.aot --mode rl`` compiles it for a TPU slice): ``decode(rows, state, pool, logits, keys, temperature,
    top_p, active, wants)`` runs one step of the pool's first ``rows`` rows (static). ``state``: the model's
    ``nnx.state`` (``graphdef``'s); ``pool``: the cache; ``logits [B, V]`` each row's last logits; ``keys [B]``
    its sampling keys; ``temperature``, ``top_p``, ``active``, ``wants`` per row. -> (tokens ``[rows]``, their
    log-probabilities (token_logprobs: ``[rows]``, ``[rows, K]`` x 2; computed when an active row ``wants``
    them), what a recording engine keeps (``record_routes``: the sampled log-probabilities ``[rows]`` and routes
    ``[rows, M, k]``; else zeros and ``[rows, 0, 0]``), the new logits, the new keys, the updated pool)."""
    record = record_routes

    def decode(rows, state, pool, logits, keys, temperature, top_p, active, wants):
        pairs = jax.vmap(jax.random.split)(keys[:rows])  # [rows, 2]
        tokens = sample_rows(logits[:rows], pairs[:, 1], temperature[:rows], top_p[:rows])
        tokens = jnp.where(active[:rows], tokens, 0)
        scored = token_logprobs(logits[:rows], tokens, MAX_LOGPROBS, jnp.any(wants[:rows] & active[:rows]))
        out, sub, stats = nnx.merge(graphdef, state).forward(tokens[:, None], cache=first_rows(pool, rows),
                                                             token_valid=active[:rows, None], record_routes=record)
        rollout = (sampled_logprobs(logits[:rows], tokens, temperature[:rows]) if record
                   else jnp.zeros((rows,), jnp.float32), _routes(stats, (rows, 1))[:, 0])
        return (tokens, scored, rollout, logits.at[:rows].set(out[:, -1]), keys.at[:rows].set(pairs[:, 0]),
                put_first_rows(pool, sub))

    return decode


def prefill_program(graphdef, *, record_routes: bool = False):
    """``prefill(state, cache, last, tokens, valid, targets, scores)`` runs a piece (tokens / valid / targets
    ``[R, W]``): each row runs all W tokens or none; an idle row keeps its KDA states and last logits
    ``[R, V]``. -> (the new last logits, the cache, the targets' token_logprobs (computed when ``scores``), the
    tokens' routes ``[R, W, M, k]`` (M = 0 unless ``record_routes``))."""

    def prefill(state, cache, last, tokens, valid, targets, scores):
        logits, new, stats = nnx.merge(graphdef, state).forward(tokens, cache=cache, token_valid=valid,
                                                                record_routes=record_routes)
        ran = jnp.any(valid, axis=1)
        return (jnp.where(ran[:, None], logits[:, -1], last), keep_rows(new, cache, ~ran),
                token_logprobs(logits, targets, MAX_LOGPROBS, scores), _routes(stats, tokens.shape))

    return prefill


def insert(pool, logits, keys, row, src, src_row, last, seed):
    """Write prefill cache ``src``'s row ``src_row`` into the pool's ``row``, its valid slots packed to end at
    the pool's write position, with its last logits and a sampling key from ``seed``."""
    packed = pack_row(src, src_row)  # skipped pieces left invalid slots between the row's tokens
    pool = write_row(pool, row, packed, pool.length - packed.length)
    return pool, logits.at[row].set(last[src_row]), keys.at[row].set(jax.random.key(seed))


def realign(pool, shift):
    """Move every row of the pool by ``shift`` slots (``cache.shift_slots``, exact)."""
    return shift_slots(pool, shift)


def traced_under(layout: Layout, fn):
    """``fn`` whose body runs under ``layout``'s tables: a jitted function is traced (its body run) at its
    first call, wherever that happens, and the tables are read then (``k3jax.sharding.axis_rules``)."""

    @functools.wraps(fn)
    def under(*args, **kwargs):
        with layout.active():
            return fn(*args, **kwargs)

    return under


class Programs:
    """Every jitted program of an engine (module docstring): ``cfg`` / ``plan`` / ``graphdef`` the model's;
    ``max_batch`` pool rows of ``max_len`` slots; prefill pieces of ``widths`` tokens (the first, the whole
    ``prefill_chunk``) for 1 and ``prefill_batch`` rows; ``block``: the prefix cache's block (None: no prefix
    cache); ``mesh``: the device mesh (None: unsharded); ``layouts``: the (decode, prefill) layouts of
    ``k3jax.sharding.LAYOUTS`` the decode and the prefill programs and their caches follow on the mesh (the
    pool and its moves the decode one's, the prefill caches and the prefix cache's blocks the prefill one's).

    - ``empty_pool()``, ``empty_prefill[rows]()``, ``zero_last[rows]()``, ``init_rows()`` (zero logits and
      keys of the pool's rows): the starting arrays;
    - ``prefill[rows, width]`` (``prefill_program``), ``insert``, ``realign(pool, shift)``;
    - ``decode[rows]`` (``decode_program``) for 1, 2, 4, ... and ``max_batch`` rows;
    - with a prefix cache, ``read_block[rows](cache, row, start)``, ``write_block[rows](cache, row, start,
      block)``, ``read_pool_block(pool, row, start)`` and ``empty_block`` (a block's shape, unjitted)."""

    def __init__(self, graphdef, cfg, plan, *, max_batch: int, max_len: int, prefill_chunk: int, prefill_batch: int,
                 widths: list[int], block: int | None, mesh, record_routes: bool, layouts: tuple[Layout, Layout]):
        c, p, b = max_len, prefill_chunk, max_batch
        # The prefill cache has a chunk more slots than a request may use: a left-padded prompt of
        # up to max_len - 1 tokens fills whole chunks. Slots are not positions, so the model's
        # max_seq_len (a position limit) does not bound them.
        wide = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, c + p))

        def empty_pool():
            return init_cache(cfg, plan, b, c)

        def empty_prefill(rows):
            return init_cache(wide, plan, rows, c + p)

        sizes = sorted({1, prefill_batch})  # the prefill programs' row counts
        decoding, prefilling = layouts
        if mesh is None:
            pool_sh, rep = None, None
            pre_sh = {r: None for r in sizes}

            def jit(fn, out_shardings, layout=decoding, **kw):
                return jax.jit(fn, **kw)
        else:  # fixed output layouts: a step's outputs are the next step's inputs, never a new signature
            pool_sh = cache_shardings(jax.eval_shape(empty_pool), mesh, decoding.rules)
            pre_sh = {r: cache_shardings(jax.eval_shape(functools.partial(empty_prefill, r)), mesh, prefilling.rules)
                      for r in sizes}
            rep = NamedSharding(mesh, PartitionSpec())

            def jit(fn, out_shardings, layout=decoding, **kw):
                return jax.jit(traced_under(layout, fn), out_shardings=out_shardings, **kw)
        self.empty_pool = jit(empty_pool, out_shardings=pool_sh)
        self.empty_prefill = {r: jit(functools.partial(empty_prefill, r), out_shardings=pre_sh[r]) for r in sizes}
        self.zero_last = {r: jit(functools.partial(jnp.zeros, (r, cfg.vocab_size), jnp.float32), out_shardings=rep)
                          for r in sizes}
        # one program per row count and width (a piece's shape)
        prefill = prefill_program(graphdef, record_routes=record_routes)
        self.prefill = {(r, w): jit(prefill, out_shardings=(rep, pre_sh[r], rep, rep), layout=prefilling,
                                    donate_argnums=(1, 2))
                        for r in sizes for w in widths}
        if block is not None:  # snapshots (replicated: one row) out of / into a prefill cache
            self.empty_block = functools.partial(init_cache, wide, plan, 1, block)
            self.read_block = {r: jit(functools.partial(read_block, size=block), out_shardings=rep, layout=prefilling)
                               for r in sizes}
            self.write_block = {r: jit(write_block, out_shardings=pre_sh[r], layout=prefilling, donate_argnums=(0,))
                                for r in sizes}
            # a pool row's block of prompt and generated tokens, as decoding reaches its end (the pool is the
            # decode layout's); None when a block is longer than a row
            self.read_pool_block = (jit(functools.partial(read_block, size=block), out_shardings=rep)
                                    if block <= max_len else None)
        self.insert = jit(insert, out_shardings=(pool_sh, rep, rep), donate_argnums=(0, 1, 2))
        self.realign = jit(realign, out_shardings=pool_sh, donate_argnums=(0,))
        decode = decode_program(graphdef, record_routes=record_routes)
        self.decode = {r: jit(functools.partial(decode, r), out_shardings=(rep, rep, rep, rep, rep, pool_sh),
                              donate_argnums=(1, 2, 3))
                       for r in sorted({min(2**i, b) for i in range(b.bit_length() + 1)})}
        self.init_rows = jax.jit(lambda: (jnp.zeros((b, cfg.vocab_size), jnp.float32),
                                          jax.random.split(jax.random.key(0), b)),
                                 **({} if rep is None else {"out_shardings": (rep, rep)}))
