"""The block-hash contract: pinned vectors (docs/block_hash.md), an independent encoder, chaining, errors."""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdserve.shared.engine.block_hash import hash_block, hash_blocks, hash_seed, model_fingerprint
from pdserve.shared.types import BlockHash

Z = bytes(32)
CONFIG: dict[str, object] = {
    "architecture": "llama",
    "hidden_size": 576,
    "num_layers": 30,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-05,
}
S_HEX = "06dd6244e40c37543a18d6c8206d4147a782838c3d4ee2d9929649d5c600bc6e"
S = BlockHash(bytes.fromhex(S_HEX))
BLOCK0_HEX = "6f0f4a797da9c6136fb44083e4212d758d8cabbe35ac5799a99181d38089e151"
BLOCK1_HEX = "52c05795713a253510a49789f09a2b9025e039711b3b53f174de89ce83711bd2"


def _ref_block(parent: bytes, tokens: list[int], extras: list[bytes]) -> bytes:
    """The encoding of docs/block_hash.md written out with struct, independent of the module."""
    data = parent + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens) + struct.pack("<I", len(extras))
    data += b"".join(struct.pack("<I", len(e)) + e for e in extras)
    return hashlib.sha256(data).digest()


def test_vectors_fingerprint() -> None:
    fp16 = model_fingerprint(CONFIG, b"dummy-seed:0", "bfloat16", 16)
    fp32 = model_fingerprint(CONFIG, b"dummy-seed:0", "bfloat16", 32)
    assert fp16.hex() == "ada1da1b78e173f10bd1edc7c60478b8407045fc626ecc48cb457ebf7d79d9f3"
    assert fp32.hex() == "4afbae86b3b29509a2805d62fab372643808cd883ef5daecb1e3a81c441f8e22"
    # Key order of the mapping does not matter (canonical JSON sorts keys).
    assert model_fingerprint(dict(reversed(CONFIG.items())), b"dummy-seed:0", "bfloat16", 16) == fp16


def test_vectors_seed() -> None:
    assert hash_seed(Z, None).hex() == S_HEX
    assert hash_seed(Z, "").hex() == "e10d8b2607a8cd4bb28c826398369e9953e86e24a5ede28faad64ba9015c9eb2"
    assert (
        hash_seed(Z, "tenant-a").hex() == "871a856b2936590c386e2c3cd0f625ec06753d8db94711f85e871c3542fe5e7d"
    )
    tag = b"pdserve.block-hash-seed.v1"
    assert hash_seed(Z, None) == hashlib.sha256(struct.pack("<I", len(tag)) + tag + Z + b"\x00").digest()
    assert (
        hash_seed(Z, "é")
        == hashlib.sha256(
            struct.pack("<I", len(tag)) + tag + Z + b"\x01" + struct.pack("<I", 2) + "é".encode()
        ).digest()
    )


def test_vectors_blocks() -> None:
    assert hash_block(S, list(range(16))).hex() == BLOCK0_HEX
    extras = [b"lora:7", b""]
    expected = "900911420217848ba3eee35925407aa3ae6f7722eff99bf1e0828c797de07a72"
    assert hash_block(S, list(range(16)), extras).hex() == expected
    assert [h.hex() for h in hash_blocks(list(range(40)), 16, S)] == [BLOCK0_HEX, BLOCK1_HEX]
    edge = [0, 1, 2**32 - 1, 49151]
    assert hash_block(S, edge).hex() == "0a1345e46328d5f66e734fb881bd28fd781cff1cc833d0f0013d5d14a27b8fb3"
    assert hash_block(S, edge) == _ref_block(S, edge, [])
    assert hash_block(S, list(range(16)), extras) == _ref_block(S, list(range(16)), extras)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 8),
    salt=st.none() | st.text(max_size=5),
)
def test_one_shot_matches_reference_chain(tokens: list[int], block_size: int, salt: str | None) -> None:
    seed = hash_seed(Z, salt)
    prev, expected = seed, []
    for i in range(len(tokens) // block_size):
        prev = BlockHash(_ref_block(prev, tokens[i * block_size : (i + 1) * block_size], []))
        expected.append(prev)
    assert hash_blocks(tokens, block_size, seed) == expected
    as_array: Any = np.asarray(tokens, dtype=np.uint32)  # an ndarray is accepted, though not a Sequence
    assert hash_blocks(as_array, block_size, seed) == expected


@given(tokens=st.lists(st.integers(0, 49151), max_size=100), cuts=st.lists(st.integers(0, 100), max_size=6))
def test_incremental_equals_one_shot(tokens: list[int], cuts: list[int]) -> None:
    """A sequence growing in arbitrary steps extends its chain from (start, parent) to the same hashes."""
    block_size = 4
    full = hash_blocks(tokens, block_size, S)
    chain: list[BlockHash] = []
    for end in [*sorted(cuts), len(tokens)]:
        prefix = tokens[: min(end, len(tokens))]
        parent = chain[-1] if chain else None
        chain += hash_blocks(prefix, block_size, S, start=len(chain), parent=parent)
    assert chain == full


def test_salts_and_fingerprints_separate_caches() -> None:
    tokens = list(range(32))
    fp_a = model_fingerprint(CONFIG, b"w", "bfloat16", 16)
    variants = {
        model_fingerprint(CONFIG, b"w2", "bfloat16", 16),
        model_fingerprint(CONFIG, b"w", "float16", 16),
        model_fingerprint(CONFIG, b"w", "bfloat16", 32),
        model_fingerprint({**CONFIG, "num_layers": 31}, b"w", "bfloat16", 16),
        fp_a,
    }
    assert len(variants) == 5
    seeds = [hash_seed(fp, salt) for fp in variants for salt in (None, "", "a", "b")]
    assert len(set(seeds)) == len(seeds)
    firsts = {hash_blocks(tokens, 16, seed)[0] for seed in seeds}
    assert len(firsts) == len(seeds)


def test_partial_block_and_extras_change_hash() -> None:
    assert hash_blocks(list(range(15)), 16, S) == []
    assert hash_block(S, [1, 2]) != hash_block(S, [1, 2], [b""])
    assert hash_block(S, [1, 2], [b"ab", b"c"]) != hash_block(S, [1, 2], [b"a", b"bc"])
    assert hash_block(S, [1, 2]) != hash_block(S, [2, 1])


@pytest.mark.parametrize(
    "bad", [[-1], [2**32], [1.5], ["7"], np.array([-3]), np.array([2**40]), np.array([0.5])]
)
def test_bad_token_ids_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="token"):
        hash_block(S, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token"):
        hash_blocks(bad, 1, S)  # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        hash_seed(b"short", None)
    with pytest.raises(ValueError, match="parent"):
        hash_block(BlockHash(b"x" * 31), [1])
    with pytest.raises(ValueError, match="needs parent"):
        hash_blocks(list(range(8)), 4, S, start=1)
    with pytest.raises(ValueError, match="parent must be None"):
        hash_blocks(list(range(8)), 4, S, start=0, parent=S)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1], 0, S)
    with pytest.raises(ValueError, match="kv_dtype"):
        model_fingerprint(CONFIG, b"w", "torch.bfloat16", 16)
    with pytest.raises(ValueError, match="block_size"):
        model_fingerprint(CONFIG, b"w", "bfloat16", 0)
    with pytest.raises(ValueError, match="JSON"):
        model_fingerprint({"eps": float("nan")}, b"w", "bfloat16", 16)
    with pytest.raises(ValueError, match="JSON"):
        model_fingerprint({"x": object()}, b"w", "bfloat16", 16)


def test_speed_8k_prompt() -> None:
    """The router hashes an 8k-token prompt per request; 512 blocks must stay around a millisecond."""
    tokens = list(np.random.default_rng(0).integers(0, 49152, size=8192).tolist())
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        hashes = hash_blocks(tokens, 16, S)
        best = min(best, time.perf_counter() - t0)
    assert len(hashes) == 512
    assert best < 3e-3, f"hash_blocks took {best * 1e3:.2f} ms for 8192 tokens"
