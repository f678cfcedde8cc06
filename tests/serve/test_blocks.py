"""normbook.serve.BlockManager alone (no model): reference counts, prefix sharing of full
and partial blocks, copy-on-write, the cached free list, truncation. Pure Python, fast;
the engine's tests check that the keys and values behind these ids are right."""

import pytest

from normbook.serve.blocks import BlockManager, Sequence

BS = 4


def filled(bm, tokens, n=None):
    """A sequence that computed tokens[:n] (all by default) and committed them."""
    seq = Sequence()
    bm.match(seq, tokens)
    n = len(tokens) if n is None else n
    bm.allocate(seq, n - seq.num_computed)
    seq.num_computed = n
    bm.commit(seq, tokens, n)
    return seq


def test_full_blocks_are_shared_by_prefix_and_counted_once():
    bm = BlockManager(16, BS)
    a = filled(bm, list(range(14)))  # 3 full blocks and 2 tokens
    assert bm.used == 4
    b = Sequence()
    taken = bm.match(b, list(range(12)) + [99, 98])
    assert taken == 12 and b.blocks == a.blocks[:3]
    assert [bm.ref[x] for x in a.blocks] == [2, 2, 2, 1] and bm.used == 4


def test_match_leaves_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = filled(bm, list(range(8)))
    b = Sequence()
    assert (
        bm.match(b, list(range(8))) == 7
    )  # one full block, 3 tokens of the next (full) one
    assert b.blocks[0] == a.blocks[0] and b.num_computed == 7


def test_a_shared_partial_block_is_copied_before_a_write():
    bm = BlockManager(16, BS)
    a = filled(bm, [1, 2, 3, 4, 5, 6])  # block 2 holds 5, 6
    b = Sequence()
    assert bm.match(b, [1, 2, 3, 4, 5, 9, 9]) == 5  # 4 + one token of a's partial
    shared = b.blocks[1]
    assert shared == a.blocks[1] and bm.ref[shared] == 2
    assert bm.blocks_needed(b, 2) == 1  # the copy; both new tokens fit in it
    copies = bm.allocate(b, 2)
    assert copies == [(shared, b.blocks[1])] and b.blocks[1] != shared
    assert bm.ref[shared] == 1 and bm.copies == 1


def test_freed_blocks_stay_cached_until_reused_least_recent_first():
    bm = BlockManager(4, BS)
    a = filled(bm, list(range(8)))  # two full blocks
    bm.free_all(a)
    assert bm.used == 0
    b = Sequence()
    assert bm.match(b, list(range(8)) + [50]) == 8  # revived from the free list
    assert bm.used == 2
    bm.free_all(b)
    c = filled(bm, [70] * 13)  # needs all 4 blocks: the cached ones are forgotten
    assert bm.used == 4
    d = Sequence()
    assert bm.match(d, list(range(8)) + [50]) == 0
    bm.free_all(c)


def test_a_write_into_a_block_forgets_the_tokens_it_overwrites():
    bm = BlockManager(8, BS)
    a = filled(bm, [1, 2, 3, 4, 5, 6])
    bm.free_all(a)
    b = Sequence()
    assert bm.match(b, [1, 2, 3, 4, 5, 7, 7]) == 5  # ref 1 now: no copy
    bm.allocate(b, 2)  # overwrites the slot that held 6
    c = Sequence()
    assert bm.match(c, [1, 2, 3, 4, 5, 6, 0]) == 5  # 6 is no longer claimed


def test_truncate_gives_back_the_blocks_past_the_kept_tokens():
    bm = BlockManager(8, BS)
    s = Sequence()
    bm.allocate(s, 10)
    assert len(s.blocks) == 3
    bm.truncate(s, 5)
    assert len(s.blocks) == 2 and s.num_computed == 5 and bm.used == 2


def test_peak_and_no_sharing_when_off():
    bm = BlockManager(8, BS, prefix_sharing=False)
    a = filled(bm, list(range(8)))
    b = Sequence()
    assert bm.match(b, list(range(8)) + [1]) == 0
    bm.allocate(b, 9)
    assert bm.peak == 5
    bm.free_all(a)
    bm.free_all(b)
    assert bm.used == 0 and bm.peak == 5


@pytest.mark.parametrize(
    "n_new, need", [(0, 0), (1, 0), (2, 0), (3, 1), (6, 1), (7, 2)]
)
def test_blocks_needed(n_new, need):
    bm = BlockManager(8, BS)
    s = Sequence()
    bm.allocate(s, 6)
    s.num_computed = 6
    assert bm.blocks_needed(s, n_new) == need
