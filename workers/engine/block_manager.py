"""Paged KV-cache bookkeeping: block allocation, reference counts and prefix caching.

Blocks hold ``block_size`` token positions. A full block that has been computed is
registered under a hash chained over the whole prefix (hash of the previous block's hash
and this block's token ids; the first block's chain starts from the request's LoRA adapter,
``Sequence.cache_salt``), so a later request with an identical prefix on the same model reuses it.
Freed blocks keep their content and hash and sit in an LRU free list: they are reused
by a prefix hit until a fresh allocation evicts them (oldest first).

Blocks are registered only once computed (after the step that filled them), never at
allocation time, so a request can never read a block another request is still filling.

Partial blocks. A prompt shorter than a block, or the tail after its last full block (a chat's
system prompt and template, a repeated question), would find nothing by full hashes alone. So the
computed positions of every block are also indexed every ``PARTIAL_GRAIN`` tokens
(``partial_index``: the hash of the previous block's hash and the block's first m tokens, m = 16,
32, ..., below a full block), the block being filled by a running request included (its computed
slots never change). After its full hits a new request looks up the longest such prefix of its
next tokens, extends it token by token against that block's known tokens, and takes a fresh block
that the step's first act fills with the cached block's content (``copies``: source, destination;
the source pinned until the step is collected, ``unpin``). Its own tokens then overwrite the
slots past the match. A hybrid model (state pool) has no state at such a point: not used there.

The block ids and tables it hands out follow the KV cache's contract (workers/attention/kv_cache.py):
ids in [0, num_blocks), a sequence's blocks in position order.

A hybrid linear-attention model (``enable_states``) also has a state pool: a slot per running
sequence, and checkpoint rows keeping the linear layers' state at some prompt block boundaries
(``plan_states``: the last full block of each prompt, and every ``state_every``-th block), each
tied to the KV block that ends there and dropped with it (eviction) or taken by a newer boundary
(the least recently freed cached block's first). A prefix hit then resumes from the last matched
block that has one (``resumable``; docs/design.md, "Hybrid linear attention").
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from workers.engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    state_row: int = -1  # a hybrid model's state checkpoint at this block's end (pool row; -1: none)
    keys: list[int] = field(default_factory=list)  # its entries in the partial-prefix index
    indexed: int = 0  # its first positions whose prefixes are indexed (a multiple of PARTIAL_GRAIN)


# A partial-block hit is looked up at multiples of this many tokens, then extended token by token.
PARTIAL_GRAIN = 16


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the previous block's hash (ints hash deterministically)."""
    return hash((prev, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences; optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order: the first is evicted first. Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # A hybrid linear-attention model's state pool slots (workers/attention/state_cache.py): free
        # slot ids, None for a model without one (enable_states).
        self.free_states: list[int] | None = None
        self.free_checkpoints: list[int] = []  # pool rows of unused state checkpoints
        self.state_every = 0  # a checkpoint at every state_every-th block of a prompt (0: the last one only)
        self.prefix_hits = 0  # whole prompt blocks found in the cache
        self.query_tokens = 0  # prompt positions that a cache could have held (all but the last)
        self.hit_tokens = 0  # of which taken from it (full blocks and partial ones)
        # Partial-block prefixes (module docstring): key -> block; off for blocks of one grain or less.
        self.partial_index: dict[int, int] = {}
        self.grain = PARTIAL_GRAIN if block_size > PARTIAL_GRAIN else 0
        self.copies: list[tuple[int, int]] = []  # (cached block, fresh block) for the step being scheduled

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def hit_rate(self) -> float:
        """The share of prompt positions (all but each prompt's last) taken from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def enable_states(self, slots: int, checkpoints: int = 0, every: int = 16) -> None:
        """A hybrid model's state pool of ``slots`` slots (rows 0 .. slots - 1: one taken by every
        admitted sequence, returned with its blocks) and ``checkpoints`` rows after them keeping
        states at block boundaries (module docstring). Without checkpoints a cached prefix could
        not resume the linear layers: prefix caching is off."""
        self.free_states = list(range(slots - 1, -1, -1))
        self.grain = 0  # no partial-block hits: the linear layers have no state inside a block
        self.free_checkpoints = list(range(slots + checkpoints - 1, slots - 1, -1))
        self.state_every = every
        if not checkpoints:
            self.enable_prefix_cache = False

    def resumable(self, hits: list[int]) -> list[int]:
        """``hits`` cut after the last block holding a state checkpoint (all of them for a model
        without a state pool): a hybrid model resumes its linear layers from there."""
        if self.free_states is None:
            return hits
        for i in range(len(hits), 0, -1):
            if self.blocks[hits[i - 1]].state_row >= 0:
                return hits[:i]
        return []

    def plan_states(self, seq: Sequence, n: int) -> tuple[int, list[tuple[int, int]]]:
        """For a step computing ``n`` tokens of ``seq``: the pool row to restore its state from
        (a prefix hit's checkpoint, taken once) and the checkpoints to save [(after m rows, row)]:
        at the end of the prompt's last full block (the one a repeat of the prompt hits) and of every
        ``state_every``-th block, within the prompt, each tied to the block ending there."""
        restore, seq.state_restore = seq.state_restore, -1
        saves: list[tuple[int, int]] = []
        if not self.enable_prefix_cache:
            return restore, saves
        bs, start = self.block_size, seq.num_computed
        last = (seq.prompt_len - 1) // bs
        for b in range(start // bs + 1, min((start + n) // bs, last) + 1):
            if b != last and not (self.state_every and b % self.state_every == 0):
                continue
            block = self.blocks[seq.block_table[b - 1]]
            if block.state_row >= 0 or block.hash is not None:
                continue
            row = self._take_checkpoint()
            if row < 0:
                break
            block.state_row = row
            saves.append((b * bs - start, row))
        return restore, saves

    def _take_checkpoint(self) -> int:
        """A free checkpoint row, else the one of the least recently freed cached block; -1: all in use."""
        if self.free_checkpoints:
            return self.free_checkpoints.pop()
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.state_row >= 0:
                row, block.state_row = block.state_row, -1
                return row
        return -1

    def _drop_checkpoint(self, block: Block) -> None:
        if block.state_row >= 0:
            self.free_checkpoints.append(block.state_row)
            block.state_row = -1

    # -- allocation ----------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
        block.token_ids = ()
        for key in block.keys:
            if self.partial_index.get(key) == block_id:
                del self.partial_index[key]
        block.keys, block.indexed = [], 0
        self._drop_checkpoint(block)
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the leading full blocks of ``seq.tokens`` (not yet taken).

        At least one token is always left to compute, since the last position's logits
        are needed.
        """
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        prev: int | None = seq.cache_salt  # a LoRA request's blocks never match another model's
        bs = self.block_size
        full = (seq.num_tokens - 1) // bs
        for i in range(full):
            ids = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(prev, ids)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            hits.append(block_id)
            prev = h
        return hits

    def match_partial(self, seq: Sequence, hits: list[int], limit: int) -> tuple[int, int]:
        """(cached block, k): the block holding the most of the positions after ``hits`` (at most
        ``limit``, below a block, and never the prompt's last); (-1, 0) when none holds a grain."""
        if not (self.grain and self.enable_prefix_cache):
            return -1, 0
        bs, start = self.block_size, len(hits) * self.block_size
        limit = min(limit, bs - 1, seq.num_tokens - 1 - start)
        prev = self.blocks[hits[-1]].hash if hits else seq.cache_salt
        want = seq.tokens[start:start + limit]
        for m in range(limit - limit % self.grain, 0, -self.grain):
            block_id = self.partial_index.get(chain_hash(prev, tuple(want[:m])))
            if block_id is None:
                continue
            known = self.blocks[block_id].token_ids
            if list(known[:m]) != want[:m]:
                continue  # a hash collision
            k = m
            while k < min(limit, len(known)) and known[k] == want[k]:
                k += 1
            return block_id, k
        return -1, 0

    def admit(self, seq: Sequence, hits: list[int], partial: tuple[int, int] = (-1, 0)) -> None:
        """Give ``seq`` the cached blocks ``hits`` (from match_prefix) as its first blocks, and the
        first ``k`` positions of block ``src`` for ``partial = (src, k)`` (match_partial): a fresh
        block to which the step copies ``src`` first (``copies``; ``src`` pinned until ``unpin``)."""
        self.prefix_hits += len(hits)
        self.query_tokens += seq.num_tokens - 1
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_computed = seq.num_cached = len(hits) * self.block_size
        src, k = partial
        if k > 0:
            self.hold(src)  # before the fresh block is taken: never the source itself
            dst = self._take_free()
            self.copies.append((src, dst))
            seq.block_table.append(dst)
            seq.num_computed = seq.num_cached = seq.num_computed + k
        self.hit_tokens += seq.num_computed
        if self.free_states is not None:
            if not self.free_states:  # the pool has maxBatchSize slots: the scheduler admits no more
                raise RuntimeError("out of state slots (more running sequences than maxBatchSize)")
            seq.state_slot = self.free_states.pop()
            # a hit resumes the linear layers from its last block's checkpoint (hits are resumable())
            seq.state_restore = self.blocks[hits[-1]].state_row if hits else -1
        seq.num_hashed_blocks = len(hits)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the step being scheduled makes first (its sources pinned)."""
        copies, self.copies = self.copies, []
        return copies

    def unpin(self, copies: list[tuple[int, int]]) -> None:
        """The step that made ``copies`` is over: their sources are the cache's again."""
        for src, _ in copies:
            self.unhold(src)

    def can_grow(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        need = self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free - reserve

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for the next ``num_new_tokens`` KV positions of ``seq``."""
        need = self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("out of KV blocks (the scheduler must check can_grow first)")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def trim(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` past its computed tokens (speculative decoding: the slots of
        rejected proposed tokens). They were never registered (registration needs computed tokens),
        so they go first in line for reuse; a kept block's stale slots are overwritten by the next
        tokens before registration can reach them."""
        keep = self.blocks_needed(seq.num_computed)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                assert block.hash is None, "a block holding uncomputed tokens was registered"
                self._drop_checkpoint(block)
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def release(self, seq: Sequence) -> None:
        """Return every block of ``seq``; hashed blocks stay reusable until evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if not block.token_ids:
                    # Content never registered is useless: put it first in line for reuse.
                    self._drop_checkpoint(block)
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.free[block_id] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        if seq.state_slot >= 0 and self.free_states is not None:
            self.free_states.append(seq.state_slot)
        seq.state_slot = -1
        seq.state_restore = -1

    # -- holds (prefill/decode disaggregation, workers/pd_transfer.py) ----------------------
    def hold(self, block_id: int) -> None:
        """One more reference on a block outside any sequence: a KV transfer's lease."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def unhold(self, block_id: int) -> None:
        """Drop a ``hold``; a hashed block stays reusable until evicted, as after ``release``."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if not block.token_ids:
                self.free.move_to_end(block_id, last=False)

    def take(self) -> int:
        """A free block for received content (evicting the least recent cached one), held once."""
        return self._take_free()

    def publish(self, block_id: int, prev: int | None, token_ids: tuple[int, ...]) -> int:
        """Register received content of a full block in the prefix cache; returns its hash."""
        h = chain_hash(prev, token_ids)
        block = self.blocks[block_id]
        block.hash, block.token_ids = h, token_ids
        self.hash_to_block.setdefault(h, block_id)
        self._index(block, prev, token_ids)
        return h

    def _index(self, block: Block, prev: int | None, token_ids: tuple[int, ...]) -> None:
        """Index the computed positions ``token_ids`` of ``block`` every grain (module docstring)."""
        block.token_ids = token_ids
        if not self.grain:
            return
        top = min(len(token_ids), self.block_size - 1)
        for m in range(block.indexed + self.grain, top + 1, self.grain):
            # the newest block holding a prefix answers for it: the least likely to be evicted first,
            # and the one a repeated request extends furthest
            key = chain_hash(prev, token_ids[:m])
            self.partial_index[key] = block.block_id
            block.keys.append(key)
            block.indexed = m

    def register_computed(self, seq: Sequence) -> None:
        """Publish newly completed full blocks of ``seq`` in the prefix cache."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        prev = (self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks
                else seq.cache_salt)
        for i in range(seq.num_hashed_blocks, full):
            ids = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(prev, ids)
            block = self.blocks[seq.block_table[i]]
            block.hash = h
            first = self.blocks[self.hash_to_block.setdefault(h, block.block_id)]
            if first is not block and block.state_row >= 0 and first.state_row < 0:
                # the same prefix computed twice: the block a hit finds gets the state checkpoint
                first.state_row, block.state_row = block.state_row, -1
            self._index(block, prev, ids)
            prev = h
        seq.num_hashed_blocks = max(full, seq.num_hashed_blocks)
        # The block being filled: its computed positions, once a grain more of them is known.
        n = seq.num_computed - full * bs
        if self.grain and n and full == seq.num_hashed_blocks and full < len(seq.block_table):
            block = self.blocks[seq.block_table[full]]
            # (its known tokens kept up to date once indexed: a repeat extends past the last grain)
            if n >= block.indexed + self.grain or (block.keys and n > len(block.token_ids)):
                self._index(block, prev, tuple(seq.tokens[full * bs:seq.num_computed]))
