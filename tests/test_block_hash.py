"""``hash_block`` is the prefix cache's identity for a block (and what traces and KV events
carry): it must stay xxhash64 over the prefix hash's 8 little-endian bytes followed by the
token ids as int64s, whichever way it is computed."""
from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvscope.engine.block_manager import NO_HASH, hash_block


def _reference(token_ids: list[int], prefix_hash: int) -> int:
    h = xxhash.xxh64()
    h.update(np.int64(prefix_hash).tobytes())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() & ((1 << 63) - 1)


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64),
       st.one_of(st.just(NO_HASH), st.integers(0, 2**63 - 1)))
def test_hash_block_is_chained_xxhash64_of_int64_tokens(token_ids, prefix_hash):
    assert hash_block(token_ids, prefix_hash) == _reference(token_ids, prefix_hash)
    assert 0 <= hash_block(token_ids, prefix_hash) < 2**63
