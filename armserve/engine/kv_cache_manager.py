"""Paged KV cache bookkeeping: a block pool with reference counts, LRU reuse and prefix caching.

The KV tensors themselves live in the model runner; this file only hands out block ids.

    request tokens:  [t0 .. t15][t16 .. t31][t32 .. t40 ......]
    block table:     [   7     ][   2      ][   9  (partial)  ]
    slot of token i: block_table[i // block_size] * block_size + i % block_size

Every *full* block gets a chained hash, hash(parent_hash, its tokens), so equal prefixes map to
the same blocks whatever request computed them. A freed block keeps its hash and stays findable
until it is handed out again; free blocks are reused least-recently-freed first, so cached
prefixes survive as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict

from armserve.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to reject hash collisions


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class KVCacheManager:
    """Allocates blocks to requests and finds cached prefixes.

    Invariant: a block is either referenced by >= 1 request (ref_cnt > 0) or in `free_queue`;
    `num_free_blocks + sum(blocks in use) == num_blocks` always holds.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (front is evicted first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # ---- prefix caching ------------------------------------------------------------------

    def _update_block_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block of the first `num_tokens` tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        toks = req.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else req.cache_salt  # (an adapter's blocks never match the base's)
            hashes.append(hash_block(parent, tuple(toks[i * bs:(i + 1) * bs])))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Blocks already holding a prefix of `req`'s tokens (not yet referenced)."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need the hidden states of every prompt token.
            return []
        # NOTE: stop one token short: the last token must be computed to get logits.
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_block_hashes(req, max_blocks * self.block_size)
        bs = self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self.cached.get(req.block_hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break  # hash collision: treat as a miss
            hit.append(block_id)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hit) * bs
        return hit

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `req` (after its computed ones).

        `new_computed_blocks` are prefix-cache hits to attach first. Returns False, changing
        nothing, when the pool cannot supply the blocks.
        """
        new_computed_blocks = new_computed_blocks or []
        held = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(held) - len(new_computed_blocks)
        # Hits that are currently free leave the free queue when attached.
        num_hits_from_free = sum(1 for b in new_computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - num_hits_from_free:
            if not held:
                del self.req_blocks[req.request_id]
            return False
        for b in new_computed_blocks:
            self._touch(b)
        held.extend(new_computed_blocks)
        for _ in range(max(num_new_blocks, 0)):
            held.append(self._pop_free_block())
        if self.enable_caching:
            # NOTE: only blocks of known tokens: draft tokens (speculative decoding) may be rejected.
            self._cache_full_blocks(req, held, min(total_tokens, req.num_tokens))
        return True

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: it no longer holds the prefix it was cached for.
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_cnt = 1
        return block_id

    def _cache_full_blocks(self, req: Request, held: list[int], num_tokens: int) -> None:
        """Register the blocks that will be full once this step's tokens are written."""
        self._update_block_hashes(req, num_tokens)
        bs = self.block_size
        for i in range(num_tokens // bs):
            block = self.blocks[held[i]]
            if block.block_hash is not None:
                continue
            h = req.block_hashes[i]
            block.block_hash = h
            block.token_ids = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            # NOTE: two requests may compute the same block at once; the first one stays indexed.
            self.cached.setdefault(h, block.block_id)

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks are queued first, so they are evicted first
        and the shared head of a prefix outlives its tails."""
        held = self.req_blocks.pop(request_id, None)
        if not held:
            return
        for block_id in reversed(held):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing worth keeping: reuse it before any cached block.
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free a request's blocks past its first `num_tokens` tokens (the slots of rejected draft
        tokens; never hashed, since only known tokens' blocks are)."""
        held = self.req_blocks.get(request_id)
        if not held:
            return
        keep = self.blocks_needed(num_tokens)
        while len(held) > keep:
            block_id = held.pop()
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
                block.token_ids = None
        self.cached.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if any block is leaked or double-counted (used by tests)."""
        in_use: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                in_use[b] = in_use.get(b, 0) + 1
        for block in self.blocks:
            expected = in_use.get(block.block_id, 0)
            assert block.ref_cnt == expected, (block.block_id, block.ref_cnt, expected)
            assert (block.block_id in self.free_queue) == (expected == 0), block.block_id
