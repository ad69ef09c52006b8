"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and the prefix cache.

A block whose tokens are all computed is keyed by a hash chained over every token before it,
so two sequences with the same prefix share blocks. Freed blocks that carry a hash stay
cached (LRU) until their space is needed; freed blocks without one are reused first.

The chain starts from a salt: a hash of the settings that shape KV values (weights'
quantisation, experts per token, kernels; `settings.kv_salt`). A block computed under one salt
is never found under another, and comes back when those settings do. A sequence whose KV spans a
salt change or a reset publishes no more blocks: its later blocks mix two computations.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_caching = prefix_caching
        self.salt = 0
        # request_id -> hash of each hashed block; None: its KV spans a salt change or a reset, so
        # its blocks are no longer published
        self._chain: dict[str, list[int] | None] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    @staticmethod
    def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens. At least one token is left to compute,
        since the next token's logits come from it."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # a prompt's log-probabilities need every prompt token computed (vLLM does the same)
        hits, prev, bs = [], self.salt, self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            prev = h
        return hits

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; blocks in use keep their contents. Returns blocks dropped."""
        dropped = len(self.hash_to_block)
        for block_id in self.hash_to_block.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids = None, ()
        self.hash_to_block.clear()
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()
        self._stop_publishing()
        return dropped

    def set_salt(self, salt: int) -> None:
        """The KV-shaping settings changed: blocks cached under the old salt stay for when they
        come back; sequences holding blocks stop publishing (their KV would mix both)."""
        if salt != self.salt:
            self.salt = salt
            self._stop_publishing()

    def _stop_publishing(self) -> None:
        for request_id in self._chain:
            self._chain[request_id] = None

    # -- allocation ---------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        hits = self.match_prefix(seq)
        idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_for(num_tokens or len(seq)) - len(hits)
        return self.num_free_blocks - idle_hits >= need

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Give seq blocks for its first num_tokens (default: all) tokens, reusing cached
        prefix blocks. Returns the number of tokens found in the cache."""
        assert not seq.block_table
        hits = self.match_prefix(seq)
        chain: list[int] = []
        self._chain[seq.request_id] = chain
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            chain.append(block.hash)
        for _ in range(self.blocks_for(num_tokens or len(seq)) - len(hits)):
            seq.block_table.append(self._take_free())
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        return seq.num_cached_tokens

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens tokens; False (and no change) if full."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True  # the common case: the current last block has room
        if need > len(self.free_plain) + len(self.free_cached):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks beyond num_tokens (rejected speculative tokens)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > max(keep, 0) and len(seq.block_table) > seq.num_hashed_blocks:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # Tail first, so a prefix's leading blocks are the last to be evicted.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        self._chain.pop(seq.request_id, None)

    def register_computed(self, seq: Sequence) -> None:
        """Publish seq's newly completed blocks to the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if seq.num_hashed_blocks >= full:
            return  # no block completed since the last call (most steps: a block holds 16 tokens)
        chain = self._chain.get(seq.request_id)
        if chain is None:
            return  # computed partly under other settings, or across a reset
        while seq.num_hashed_blocks < full:
            i = seq.num_hashed_blocks
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(chain[-1] if chain else self.salt, tokens)
            chain.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.id
            seq.num_hashed_blocks += 1

    def _take_free(self) -> int:
        if self.free_plain:
            block_id = self.free_plain.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)  # evict least recently used
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            if block.hash is not None:
                self.free_cached[block_id] = None
            else:
                self.free_plain.append(block_id)

    def check_idle(self) -> None:
        """Invariant when no sequence holds blocks: every ref count is back to zero."""
        busy = [b.id for b in self.blocks if b.ref_count]
        assert not busy, f"blocks still referenced while idle: {busy[:10]}"
