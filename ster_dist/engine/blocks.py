"""The KV block pool: which fixed-size cache blocks are free, held, or cached for reuse.

Every rank holds the same paged KV tensors, indexed by block id; this pool (on the driver) only
hands out ids, so the ranks never allocate. Block 0 (NULL_BLOCK) is never handed out: a block table
can name it where a sliding window released a block, and ranks may point padding at it.

A block is in exactly one state:
  held       reference count > 0 (one reference per sequence whose block table names it);
  cached     count 0 but registered under a prefix hash: reusable by match_prefix, and evictable
             by allocate, least recently released first;
  free       count 0 and unregistered.

Prefix caching. A full block's key is a digest chained over every block before it (digest_i =
blake2b(digest_{i-1} || tokens of block i)), so equal tokens after different prefixes never share a
block: a block's k/v depend on every earlier token. The chain's root is a salt naming what else the
k/v depend on (an adapter, a steering vector): sequences share blocks only when salts are equal.
blake2b (256 bits) rather than Python's hash(): a collision would silently serve another prompt's
cache, and hash() is 64 bits and, for str salts, randomized per process.

The table maps each digest to at most one block and each block to at most one digest, so it never
holds more than num_blocks entries; an evicted block's digest is dropped with it.

Speculative decoding (engine/drafter.py) keeps a second cache beside each block: the MTP layer's
keys, written a step behind the model's (the MTP row at position q reads token q + 1), and only for
sequences that draft. A block is marked drafted once its MTP keys are all written, with the token
after it that its last one read (`mark_drafted`); a drafting sequence shares only the leading blocks
so marked whose next token is its own (`drafted_prefix`). Handing a block out again drops its mark.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque

NULL_BLOCK = 0


def _digest(parent: bytes, block_tokens) -> bytes:
    h = hashlib.blake2b(parent, digest_size=32)
    h.update(struct.pack(f"<{len(block_tokens)}q", *block_tokens))
    return h.digest()


class BlockHashes:
    """The chained digests of one token sequence's full blocks, extended as the sequence grows.

    A sequence keeps one of these so each block is hashed once in its life rather than at every
    step: its tokens only ever grow, so a digest once computed stays right."""

    def __init__(self, block_size: int, salt: str | bytes = b""):
        self.block_size = block_size
        salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        # the root differs from any block digest's input shape, so a salt cannot pose as a block
        self._root = hashlib.blake2b(b"ster_dist.kv-prefix\0" + salt, digest_size=32).digest()
        self.digests: list[bytes] = []

    def extend(self, tokens, num_tokens: int | None = None) -> list[bytes]:
        """Hash the full blocks of tokens[:num_tokens] not hashed yet; returns all digests."""
        end = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        bs = self.block_size
        for i in range(len(self.digests), end // bs):
            parent = self.digests[-1] if self.digests else self._root
            self.digests.append(_digest(parent, tokens[i * bs : (i + 1) * bs]))
        return self.digests


class BlockPool:
    """Fixed-size KV blocks shared by every rank (ranks hold the tensors; the pool holds only
    ids)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(
                f"a pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        # count-0 registered blocks, oldest release first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0
        # block -> the token after it, for blocks whose MTP keys (speculative decoding) are all
        # written
        self._drafted: dict[int, int] = {}

    # ---- reading

    @property
    def usable_blocks(self) -> int:
        """Every block that can ever be handed out (all but NULL_BLOCK)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks allocate() can hand out now: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_registered(self, block: int) -> bool:
        return block in self._digest_of

    def stats(self) -> dict:
        cached = len(self._cached)
        free = len(self._free)
        queried = self._queried_tokens
        return {
            "total": self.usable_blocks,
            "used": self.usable_blocks - cached - free,
            "cached": cached,
            "free": free,
            "prefix_queries": queried,
            "prefix_hits": self._hit_tokens,
            "hit_rate": self._hit_tokens / queried if queried else 0.0,
        }

    # ---- prefix cache

    def match_prefix(
        self, tokens, hashes: BlockHashes | None = None, record: bool = True
    ) -> list[int]:
        """Ids of cached full blocks holding tokens' longest block-aligned prefix, one reference
        taken on each. At most (len(tokens)-1)//block_size blocks: at least one token is left to
        compute, since the last token's logits give the next one.

        hashes: the sequence's digest memo (its salt included), extended here as far as looked up;
        without one the chain is rooted at the empty salt. record=False leaves the query out of
        stats, for a caller that may take the match back (see record_query)."""
        if not self.prefix_caching:
            return []
        hashes = hashes if hashes is not None else BlockHashes(self.block_size)
        limit = max(0, (len(tokens) - 1) // self.block_size)
        matched: list[int] = []
        for i in range(limit):
            digests = hashes.extend(tokens, (i + 1) * self.block_size)
            block = self._block_of.get(digests[i])
            if block is None:
                break
            matched.append(block)
        for block in matched:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        if record:
            self.record_query(len(tokens), len(matched) * self.block_size)
        return matched

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prefix lookup in stats (match_prefix does this unless told not to)."""
        self._queried_tokens += queried_tokens
        self._hit_tokens += hit_tokens

    def register(
        self, blocks: list[int], digests: list[bytes], start: int = 0, stop: int | None = None
    ) -> None:
        """Register blocks[i] under digests[i] for start <= i < stop: the blocks must be held and
        their k/v computed. A NULL_BLOCK entry is skipped; a digest some other block already holds
        leaves this block unregistered (it stays private and goes free on release); re-registering a
        block under its own digest is a no-op."""
        if not self.prefix_caching:
            return
        stop = (
            min(len(blocks), len(digests)) if stop is None else min(stop, len(blocks), len(digests))
        )
        for i in range(start, stop):
            block, digest = blocks[i], digests[i]
            if block == NULL_BLOCK:
                continue
            known = self._digest_of.get(block)
            if known == digest:
                continue
            if known is not None:
                raise ValueError(
                    f"block {block} is registered under another prefix: the block table "
                    "or the tokens given do not belong together"
                )
            if self._refs[block] == 0:
                raise ValueError(
                    f"block {block} is not held: only a held, computed block can be registered"
                )
            if digest in self._block_of:
                continue
            self._digest_of[block] = digest
            self._block_of[digest] = block

    def mark_drafted(self, block: int, follow: int) -> None:
        """Every MTP key of a held block is written, its last one reading `follow` as the next
        token."""
        if block != NULL_BLOCK:
            self._drafted[block] = follow

    def drafted_prefix(self, blocks: list[int], tokens) -> int:
        """How many leading blocks (blocks[i] holding tokens[i*bs:(i+1)*bs]) have their MTP keys
        written as this sequence's own would be: marked drafted, the token after each the one it has
        there."""
        bs = self.block_size
        kept = 0
        while (
            kept < len(blocks)
            and (kept + 1) * bs < len(tokens)
            and self._drafted.get(blocks[kept]) == tokens[(kept + 1) * bs]
        ):
            kept += 1
        return kept

    def commit(self, tokens, blocks: list[int], hashes: BlockHashes | None = None) -> None:
        """Register every full block of tokens (blocks[i] holds tokens[i*bs:(i+1)*bs]) in the prefix
        cache, after the ranks computed them. Idempotent."""
        if not self.prefix_caching:
            return
        hashes = hashes if hashes is not None else BlockHashes(self.block_size)
        self.register(blocks, hashes.extend(tokens))

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (cached blocks go free, held ones private): for when the k/v a
        prefix gave no longer hold, e.g. the weights changed in place."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._digest_of.clear()
        self._block_of.clear()

    # ---- handing out and taking back

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, one reference each, or None (and nothing taken) when fewer than n can be had.
        Free blocks go first; then cached ones are evicted, least recently released first, so a
        prefix someone may still ask for survives as long as the pool allows."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_blocks:
            return None
        taken = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._digest_of.pop(block)]
            self._refs[block] = 1
            self._drafted.pop(block, None)  # its keys are about to be another sequence's
            taken.append(block)
        return taken

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block (NULL_BLOCK ignored). At zero a registered block becomes
        cached, an unregistered one free. Blocks are released last to first, so a sequence's tail
        is evicted before its head: the head serves every prompt sharing its start, the tail only
        prompts equal to this one for as long."""
        for block in reversed(blocks):
            if block == NULL_BLOCK:
                continue
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} released more often than it was taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
