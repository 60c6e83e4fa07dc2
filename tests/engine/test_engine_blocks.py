"""The KV block pool: handing out, taking back, the prefix cache and its eviction order."""

from __future__ import annotations

import pytest

from ster_dist.engine.blocks import NULL_BLOCK, BlockHashes, BlockPool


def held_states_add_up(pool: BlockPool) -> None:
    s = pool.stats()
    assert s["used"] + s["cached"] + s["free"] == s["total"] == pool.num_blocks - 1
    assert s["used"] == sum(1 for b in range(1, pool.num_blocks) if pool.refs(b) > 0)
    assert pool.refs(NULL_BLOCK) == 0


def test_allocate_release_reuse():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.free_blocks == 4
    a = pool.allocate(3)
    assert sorted(a) == [1, 2, 3] and pool.free_blocks == 1
    held_states_add_up(pool)
    pool.release(a)
    assert pool.free_blocks == 4
    b = pool.allocate(4)
    assert sorted(b) == [1, 2, 3, 4]
    held_states_add_up(pool)


def test_allocate_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.allocate(4) is None
    assert pool.free_blocks == 3 and pool.stats()["used"] == 0
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_null_block_never_handed_out():
    pool = BlockPool(num_blocks=3, block_size=1)
    for _ in range(5):
        got = pool.allocate(2)
        assert NULL_BLOCK not in got
        pool.release(got + [NULL_BLOCK])  # a null entry in a table is ignored
    assert pool.allocate(3) is None


def test_over_release_is_refused():
    pool = BlockPool(num_blocks=3, block_size=1)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError):
        pool.release([b])


def test_prefix_hit_after_commit_and_release():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    blocks = pool.allocate(3)
    pool.commit(prompt, blocks)
    assert [pool.is_registered(b) for b in blocks] == [True, True, False]
    pool.release(blocks)
    assert pool.stats()["cached"] == 2 and pool.stats()["free"] == 7

    hit = pool.match_prefix(prompt + [99])
    assert hit == blocks[:2]
    assert all(pool.refs(b) == 1 for b in hit)
    assert pool.stats()["cached"] == 0
    held_states_add_up(pool)


def test_match_leaves_one_token_to_compute():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(8))  # exactly two blocks
    blocks = pool.allocate(2)
    pool.commit(prompt, blocks)
    pool.release(blocks)
    assert pool.match_prefix(prompt) == blocks[:1]  # the last token's logits are still needed
    assert pool.match_prefix(prompt + [8]) == blocks
    assert pool.match_prefix([]) == []
    assert pool.match_prefix(prompt[:1]) == []


def test_shared_block_takes_one_reference_per_holder():
    pool = BlockPool(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    pool.commit(prompt, blocks)
    hit = pool.match_prefix(prompt)  # while the first holder still runs
    assert hit == blocks[:2] and pool.refs(blocks[0]) == 2
    pool.release(blocks)
    assert pool.refs(blocks[0]) == 1 and pool.stats()["cached"] == 0
    pool.release(hit)
    assert pool.stats()["cached"] == 2
    held_states_add_up(pool)


def test_hashes_chain_over_the_prefix():
    pool = BlockPool(num_blocks=10, block_size=2)
    first = [1, 2, 3, 4, 0]
    blocks = pool.allocate(2)
    pool.commit(first, blocks)
    pool.release(blocks)
    # block [3, 4] after a different first block is different k/v: no match
    assert pool.match_prefix([9, 9, 3, 4, 0]) == []
    # and [1, 2] matches only as the first block, not in second place
    assert pool.match_prefix([3, 4, 1, 2, 0]) == []
    assert pool.match_prefix([1, 2, 7, 7, 0]) == blocks[:1]


def test_salt_separates_caches():
    pool = BlockPool(num_blocks=10, block_size=2)
    prompt = [1, 2, 3, 4, 0]
    blocks = pool.allocate(2)
    pool.commit(prompt, blocks, BlockHashes(2, salt="adapter-a"))
    pool.release(blocks)
    assert pool.match_prefix(prompt) == []
    assert pool.match_prefix(prompt, BlockHashes(2, salt="adapter-b")) == []
    assert pool.match_prefix(prompt, BlockHashes(2, salt="adapter-a")) == blocks


def test_digests_are_deterministic_and_incremental():
    tokens = list(range(100, 130))
    whole = BlockHashes(4).extend(tokens)
    grown = BlockHashes(4)
    for n in range(len(tokens) + 1):
        grown.extend(tokens, n)
    assert whole == grown.digests and len(whole) == 7
    assert len(set(whole)) == 7
    assert BlockHashes(4, salt="x").extend(tokens) != whole


def test_commit_is_idempotent_and_duplicates_stay_private():
    pool = BlockPool(num_blocks=10, block_size=2)
    prompt = [5, 6, 7, 8]
    a = pool.allocate(2)
    pool.commit(prompt, a)
    pool.commit(prompt, a)
    b = pool.allocate(2)  # the same tokens computed again elsewhere (both ran at once)
    pool.commit(prompt, b)
    assert not any(pool.is_registered(x) for x in b)
    pool.release(b)
    assert pool.stats()["free"] == 7  # duplicates go free, not cached
    pool.release(a)
    assert pool.stats()["cached"] == 2


def test_register_checks_the_table():
    pool = BlockPool(num_blocks=10, block_size=2)
    a = pool.allocate(1)
    pool.commit([1, 2], a)
    with pytest.raises(ValueError):
        pool.commit([3, 4], a)  # the block already holds another prefix
    b = pool.allocate(1)
    pool.release(b)
    with pytest.raises(ValueError):
        pool.commit([3, 4], b)  # not held
    pool.commit([1, 2, 3, 4], [NULL_BLOCK] + pool.allocate(1))  # a window-released entry is skipped


def test_eviction_is_least_recently_released_first():
    pool = BlockPool(num_blocks=5, block_size=1)
    seqs = {}
    for name, tok in (("a", 10), ("b", 20), ("c", 30), ("d", 40)):
        seqs[name] = pool.allocate(1)
        pool.commit([tok], seqs[name])
    for name in ("b", "d", "a", "c"):
        pool.release(seqs[name])
    assert pool.stats()["cached"] == 4 and pool.stats()["free"] == 0
    got = pool.allocate(2)
    assert got == seqs["b"] + seqs["d"]
    # their prefixes are gone with them; the others still match
    assert pool.match_prefix([20, 0]) == [] and pool.match_prefix([40, 0]) == []
    assert pool.match_prefix([10, 0]) == seqs["a"]
    held_states_add_up(pool)


def test_matching_refreshes_nothing_but_protects_the_block():
    pool = BlockPool(num_blocks=3, block_size=1)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.commit([1], a)
    pool.commit([2], b)
    pool.release(a)
    pool.release(b)
    hit = pool.match_prefix([1, 0])  # a is held again: not evictable
    assert pool.allocate(2) is None
    assert pool.allocate(1) == b
    pool.release(hit)
    assert pool.allocate(1) == a


def test_a_sequence_tail_is_evicted_before_its_head():
    pool = BlockPool(num_blocks=4, block_size=1)
    blocks = pool.allocate(3)
    pool.commit([1, 2, 3], blocks)
    pool.release(blocks)
    assert pool.allocate(1) == [blocks[2]]
    assert pool.match_prefix([1, 2, 3, 4]) == blocks[:2]


def test_stats_count_tokens_and_hit_rate():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(9))
    assert pool.stats()["hit_rate"] == 0.0
    assert pool.match_prefix(prompt) == []
    blocks = pool.allocate(3)
    pool.commit(prompt, blocks)
    pool.release(blocks)
    hit = pool.match_prefix(prompt)
    s = pool.stats()
    assert s["prefix_queries"] == 18 and s["prefix_hits"] == 8
    assert s["hit_rate"] == pytest.approx(8 / 18)
    pool.release(hit)
    pool.match_prefix(prompt, record=False)
    assert pool.stats()["prefix_queries"] == 18


def test_table_holds_at_most_one_entry_per_block():
    pool = BlockPool(num_blocks=4, block_size=1)
    for start in range(0, 300, 3):
        blocks = pool.allocate(3)
        pool.commit([start, start + 1, start + 2], blocks)
        pool.release(blocks)
    assert len(pool._block_of) == len(pool._digest_of) <= pool.num_blocks - 1
    held_states_add_up(pool)


def test_prefix_caching_off():
    pool = BlockPool(num_blocks=6, block_size=2, prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    pool.commit(prompt, blocks)
    assert not any(pool.is_registered(b) for b in blocks)
    pool.release(blocks)
    assert pool.match_prefix(prompt) == []
    assert pool.stats()["cached"] == 0 and pool.stats()["free"] == 5
    assert pool.stats()["prefix_queries"] == 0


def test_forget_prefixes_empties_the_cache():
    pool = BlockPool(num_blocks=6, block_size=2)
    held, released = pool.allocate(2), pool.allocate(2)
    pool.commit([1, 2, 3, 4], held)
    pool.commit([5, 6, 7, 8], released)
    pool.release(released)
    pool.forget_prefixes()
    assert pool.stats()["cached"] == 0 and pool.stats()["free"] == 3
    assert pool.match_prefix([5, 6, 7, 8, 0]) == [] and pool.match_prefix([1, 2, 3, 4, 0]) == []
    pool.release(held)
    assert pool.stats()["free"] == 5  # unregistered now: free, not cached
    held_states_add_up(pool)


def test_pool_size_checked():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_size=4)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)


def test_drafted_blocks_count_only_with_the_same_next_token_and_lose_their_mark_when_handed_out_again():
    """Speculative decoding's MTP keys: a drafting sequence shares a block only when its MTP keys
    were all written and the last one read the token this sequence has after it."""
    pool = BlockPool(num_blocks=4, block_size=2)
    tokens = [10, 11, 12, 13, 14, 15]
    blocks = pool.allocate(3)
    pool.commit(tokens, blocks)
    assert pool.drafted_prefix(blocks, tokens) == 0  # registered, but no MTP key marked written
    pool.mark_drafted(blocks[0], 12)
    pool.mark_drafted(blocks[1], 14)
    assert pool.drafted_prefix(blocks, tokens) == 2
    # block 1's last key read 14, not 99
    assert pool.drafted_prefix(blocks, [10, 11, 12, 13, 99, 15]) == 1
    assert pool.drafted_prefix(blocks, [10, 11, 99]) == 0
    pool.release(blocks)
    # the same ids, handed out afresh: their keys will be another sequence's
    again = pool.allocate(3)
    assert sorted(again) == sorted(blocks)
    assert pool.drafted_prefix(blocks, tokens) == 0
