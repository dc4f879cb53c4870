"""The engine's prefix cache: prompt blocks already prefilled, kept so a later prompt that starts with the
same tokens skips them.

A trie of blocks of ``block`` tokens (a multiple of the engine's prefill chunk). A node stands for the
prompt prefix ending with its block (its ancestors' blocks before it) and holds what prefilling that
prefix left in a cache row, as an opaque value (the engine's ``k3jax.cache.read_block`` snapshot: the
block's MLA latent slots and the KDA recurrent states and short-conv tails at the block's end).
KDA layers carry the whole prefix in a fixed-size state, not in per-token slots, so a hit can only
resume where a snapshot was taken: at a block boundary, from the deepest cached node on the prompt's
path.

How the engine (``k3jax.serving.engine``) uses it: after each whole prefill chunk that ends a block of
``prefix_cache_block`` prompt tokens, and after each decode step that completes a block of a row's prompt
and generated tokens, the row's snapshot there (the block's MLA latent slots, copied out, and its KDA
states and conv tails: ``cache.read_block``) is taken, and joins the trie when the prefill ends (a
generated block once the step's tokens are read: they are its key). So a conversation's next turn, whose prompt repeats the last one and its reply,
resumes after the reply. A new prompt (one that does not ask for its prompt's log-probabilities) looks up
its longest cached block prefix (leaving at least its last token to run): the blocks are written into its
prefill row (``cache.write_block``) and only the rest is prefilled, with the same chunk boundaries as
without the cache. Blocks are copied, not shared: a pool row is one contiguous run of slots that moves
(``shift_slots``), not a table of blocks. They stay on the device (a hit costs copies there, no
transfer).

An engine that records rollouts (``record_routes``, reinforcement learning) keeps each block's tokens'
experts with it (``Node.routes``, host memory: the routes of the step that first ran them), so a prompt that
resumes from cached blocks still has every token's routes, and a multi-turn episode's next turn prefills
only what follows its last cached block (``k3jax.rl.episodes``).

Memory is bounded by ``max_tokens`` (``block`` tokens per node): inserting past it evicts the least
recently used leaves (a node is used when a lookup or an insert passes through it); an inner node is
evicted only once its children are, so every node's prefix stays whole. Host-side bookkeeping only:
the engine owns the device arrays and decides when to look up and insert.
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # the block's tokens
    parent: "Node | None"
    value: object = None  # the engine's snapshot of the prefix ending with this block
    routes: object = None  # a recording engine's: the block's tokens' experts [block, M, k] (when they first ran)
    children: dict = dataclasses.field(default_factory=dict)  # key -> Node
    used: int = 0  # the lookup / insert clock when last passed through


class PrefixCache:
    """Block trie with an LRU token budget (see the module docstring)."""

    def __init__(self, block: int, max_tokens: int):
        if block < 1:
            raise ValueError(f"prefix cache block must be >= 1 token, got {block}")
        if max_tokens < block:
            raise ValueError(f"prefix cache budget ({max_tokens} tokens) holds no block of {block} tokens")
        self.block, self.max_tokens = block, max_tokens
        self._root = Node((), None)
        self._nodes: set[Node] = set()
        self._clock = itertools.count(1)

    @property
    def tokens(self) -> int:
        """Tokens held (``block`` per node)."""
        return len(self._nodes) * self.block

    def _blocks(self, tokens, end: int):
        return (tuple(tokens[i:i + self.block]) for i in range(0, end, self.block))

    def lookup(self, tokens, limit: int) -> list[Node]:
        """The cached nodes along ``tokens``' path, root first, covering at most ``limit`` tokens (the
        deepest one's prefix is the longest cached one); marks them used."""
        path, node, now = [], self._root, next(self._clock)
        for key in self._blocks(tokens, limit // self.block * self.block):
            node = node.children.get(key)
            if node is None:
                break
            node.used = now
            path.append(node)
        return path

    def has(self, tokens, end: int) -> bool:
        """Whether the prefix ``tokens[:end]`` (``end`` a multiple of ``block``) is cached."""
        node = self._root
        for key in self._blocks(tokens, end):
            node = node.children.get(key)
            if node is None:
                return False
        return True

    def insert(self, tokens, end: int, value, routes=None) -> bool:
        """Cache ``value`` (and the block's ``routes``, a recording engine's) as the prefix ``tokens[:end]``
        (``end`` a multiple of ``block``), evicting least recently used leaves for room. False (nothing
        stored) when the prefix before its last block is not cached (it was evicted since) or when it is
        cached already."""
        parent, now = self._root, next(self._clock)
        for key in self._blocks(tokens, end - self.block):
            parent = parent.children.get(key)
            if parent is None:
                return False
            parent.used = now
        key = tuple(tokens[end - self.block:end])
        if key in parent.children:
            return False
        while self.tokens + self.block > self.max_tokens:
            leaves = [n for n in self._nodes if not n.children and n is not parent]
            if not leaves:  # only the new block's own ancestors are left
                return False
            self._evict(min(leaves, key=lambda n: n.used))
        node = Node(key, parent, value, routes, used=now)
        parent.children[key] = node
        self._nodes.add(node)
        return True

    def insert_generated(self, blocks) -> None:
        """Insert ``[(tokens, end, value, routes)]``, blocks a decode step completed: each the prefix
        ``tokens[:end]`` of a request's prompt and generated tokens, skipped where the request stopped before
        ``end`` (its token at ``end`` was dropped) or the prefix is cached already."""
        for tokens, end, value, routes in blocks:
            if len(tokens) == end and not self.has(tokens, end):
                self.insert(tokens, end, value, routes)

    def _evict(self, node: Node) -> None:
        del node.parent.children[node.key]
        self._nodes.discard(node)
        node.value = node.routes = None

    def clear(self) -> None:
        for node in list(self._nodes):
            node.value = node.routes = None
        self._root.children.clear()
        self._nodes.clear()
