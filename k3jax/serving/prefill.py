"""How the engine prefills a batch of prompts: the pieces (one device call each) that run them, and the
state of a prefill between pieces. Each prompt runs from its first uncached token in whole
``prefill_chunk`` pieces (a row with fewer chunks joins later: every row's last chunks run together),
then its remainder (< ``prefill_chunk`` tokens) in pieces of its binary digits; in a piece a row runs
the piece's width of tokens or none. So a prompt's chunk boundaries fall at multiples of ``prefill_chunk``
from its start, where the prefix cache takes and resumes snapshots, and the pieces have few shapes."""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.serving.logprobs import TokenLogprobs, read_logprobs
from k3jax.serving.request import Sequence


def piece_widths(prefill_chunk: int) -> list[int]:
    """The pieces' widths: a whole chunk, then the powers of two below it (a remainder's binary digits)."""
    return [prefill_chunk] + [2**k for k in reversed(range(prefill_chunk.bit_length())) if 2**k < prefill_chunk]


@dataclasses.dataclass
class Piece:
    """One prefill call: each row runs ``width`` prompt tokens from ``starts[row]``, or none (-1)."""
    tokens: np.ndarray  # [R, W]
    valid: np.ndarray  # [R, W] a row's whole width or none of it
    targets: np.ndarray  # [R, W] each position's next prompt token (past the prompt's end: 0, unused)
    starts: list[int]  # per row: the prompt index of its first token here, -1: the row is idle
    snapshots: list[tuple[int, int]]  # (row, prompt tokens done) of the rows that end a cache block here


def plan_pieces(prompts: list[list[int]], done: list[int], rows: int, widths: list[int], block: int) -> list[Piece]:
    """The pieces that prefill ``prompts`` (row i: ``prompts[i]``, its first ``done[i]`` tokens already in the
    cache) in a ``rows``-row prefill cache; ``widths``: ``piece_widths(prefill_chunk)``; ``block``: the prefix
    cache's block (0: none), whose ends the pieces mark as snapshots."""
    p, done = widths[0], list(done)
    rest = [len(prompt) - h for prompt, h in zip(prompts, done)]
    chunks = max(r // p for r in rest)

    def piece(width: int, active: list[int]) -> Piece:
        tokens, valid, targets = (np.zeros((rows, width), t) for t in (np.int32, bool, np.int32))
        starts, snapshots = [-1] * rows, []
        for i in active:
            prompt, a = prompts[i], done[i]
            tokens[i], valid[i] = prompt[a:a + width], True
            after = prompt[a + 1:a + width + 1]
            targets[i, :len(after)] = after
            starts[i], done[i] = a, a + width
            if block and done[i] % block == 0:
                snapshots.append((i, done[i]))
        return Piece(tokens, valid, targets, starts, snapshots)

    # whole chunks, each row's last ones together; then the remainders' binary digits
    pieces = [piece(p, [i for i, r in enumerate(rest) if r // p >= chunks - j]) for j in range(chunks)]
    for w in widths[1:]:
        active = [i for i, r in enumerate(rest) if r % p & w]
        if active:
            pieces.append(piece(w, active))
    return pieces


def take_prompts(queue, n: int, cached_prefix, block: int, chunk: int, max_len: int) -> tuple[list, list]:
    """Up to ``n`` requests taken from the front of ``queue`` (a deque of Sequences) to prefill together, and
    each one's cached prefix nodes (``cached_prefix(seq)``, ``block`` tokens each). Their slots must fit the
    prefill cache (``max_len + chunk``): the longest cached prefix, then whole chunks for the longest uncached
    rest, then < one chunk of remainder pieces."""
    seqs, hits, prefix, chunks = [], [], 0, 0
    while queue and len(seqs) < n:
        nodes = cached_prefix(queue[0])
        h = len(nodes) * block
        grown = (max(prefix, h), max(chunks, (len(queue[0].prompt) - h) // chunk))
        if seqs and grown[0] + grown[1] * chunk > max_len + 1:
            break
        prefix, chunks = grown
        seqs.append(queue.popleft())
        hits.append(nodes)
    return seqs, hits


@dataclasses.dataclass
class Prefill:
    """A prefill in progress: its requests, their pieces, its cache and the pieces' outputs so far, which
    become its requests' prompt log-probabilities and routes once the last piece has run."""
    seqs: list[Sequence | None]  # row i of the prefill batch is seqs[i] (None: cancelled, still computed)
    prompts: list[list[int]]  # their prompts
    pieces: list[Piece]
    cache: object
    last: object  # each row's last logits [R, V]
    length: int  # slots written so far (host copy of cache.length)
    scores: bool = False  # some request wants its prompt's log-probabilities
    done: int = 0  # pieces run so far
    scored: list = dataclasses.field(default_factory=list)  # per piece: token_logprobs' arrays [R, W(, K)]
    routes: list = dataclasses.field(default_factory=list)  # per piece (record_routes): [R, W, M, k]
    # per row (record_routes): the routes of its cached prefix's blocks, [block, M, k] each, root first
    cached_routes: list = dataclasses.field(default_factory=list)
    # (row, end, snapshot): the prefix-cache blocks the pieces ended, inserted once the prefill is done (when a
    # recording engine knows their tokens' routes)
    snapshots: list = dataclasses.field(default_factory=list)

    def set_prompt_logprobs(self) -> None:
        """Each scoring request's ``prompt_logprobs`` from the pieces' outputs: prompt token t's entry
        comes from the position before it (its first token has none). Scoring rows have no cached
        prefix: every position ran in some piece."""
        scored = [tuple(np.asarray(a) for a in arrays) for arrays in self.scored]  # (own, top, ids) per piece
        for row, seq in enumerate(self.seqs):
            if seq is None or not seq.params.prompt_logprobs:
                continue
            k, n = seq.params.logprobs or 0, len(seq.prompt)
            entries: list[TokenLogprobs | None] = [None] * n
            for piece, (own, top, ids) in zip(self.pieces, scored):
                a = piece.starts[row]
                for q in range(piece.tokens.shape[1] if a >= 0 else 0):
                    if a + q + 1 < n:
                        entries[a + q + 1] = read_logprobs(own[row, q], top[row, q], ids[row, q], k)
            seq.prompt_logprobs = entries

    def row_routes(self) -> list[np.ndarray]:
        """Each row's prompt routes ``[n, M, k]`` (the experts each prompt token used, as input): its cached
        prefix's, kept with the blocks, then the pieces'."""
        routes = [np.asarray(r) for r in self.routes]  # per piece [R, W, M, k]
        out = []
        for row in range(len(self.prompts)):
            parts = sorted(((piece.starts[row], r[row]) for piece, r in zip(self.pieces, routes)
                            if piece.starts[row] >= 0), key=lambda p: p[0])
            out.append(np.concatenate([*self.cached_routes[row], *(r for _, r in parts)], axis=0))
        return out
