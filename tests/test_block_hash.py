import pytest

from common.block_hash import block_hashes, hash_seed

SEED = hash_seed("tandem-tiny")


def test_pinned_vectors():
    # Pinned: a change here changes every block identity in the fleet (router, workers, mocker).
    assert hash_seed("tandem-tiny") == 4960703440239728671
    assert block_hashes(list(range(40)), 16, SEED) == [12275610413435333185, 6319139293693073752]
    assert block_hashes([1, 2, 3, 4], 2, 0) == [254984204845929552, 7385961675745139444]


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16, SEED) == []
    assert len(block_hashes(list(range(33)), 16, SEED)) == 2


def test_equal_prefixes_equal_hashes_and_chaining():
    a = block_hashes([7] * 16 + [1] * 16 + [2] * 16, 16, SEED)
    b = block_hashes([7] * 16 + [1] * 16 + [3] * 16, 16, SEED)
    assert a[:2] == b[:2] and a[2] != b[2]
    # The same block content after a different prefix hashes differently (chained).
    c = block_hashes([8] * 16 + [1] * 16, 16, SEED)
    assert c[1] != a[1]
    # Continuation with parent equals hashing the whole.
    assert block_hashes([1] * 16 + [2] * 16, 16, SEED, parent=a[0]) == a[1:]


@pytest.mark.parametrize("other", [dict(seed=hash_seed("other-model")), dict(seed=hash_seed("tandem-tiny", cache_salt="t1")),
                                   dict(seed=hash_seed("tandem-tiny", lora="adapter"))])
def test_salt_changes_hashes(other):
    tokens = list(range(32))
    assert block_hashes(tokens, 16, SEED) != block_hashes(tokens, 16, other["seed"])


def test_block_size_changes_hashes():
    tokens = list(range(32))
    assert block_hashes(tokens, 16, SEED)[0] != block_hashes(tokens, 8, SEED)[1]
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0, SEED)
