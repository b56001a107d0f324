"""The block-hash contract (contract 1 in docs/architecture.md; encoding, test vectors: docs/block_hash.md).

Invariants:
- Every hash is 32 bytes of SHA-256 over an encoding fixed by docs/block_hash.md; changing a byte of it
  changes every cached prefix in the cluster, so the domain tags carry a version ("v1").
- Only full blocks are hashed; block i's hash chains over block i-1's, and block 0 chains over the seed.
- The seed covers the model fingerprint and the tenant's cache salt: an absent salt (None) and an empty
  salt ("") give different seeds, so a tenant configured with "" never shares with unsalted traffic.
- Token ids are encoded as little-endian uint32; ids outside [0, 2**32) are a ValueError, never wrapped.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence

import numpy as np
from pdserve.shared.types import BlockHash

HASH_SIZE = 32
FINGERPRINT_TAG = b"pdserve.model-fingerprint.v1"
SEED_TAG = b"pdserve.block-hash-seed.v1"
_U32_MAX = 2**32 - 1
_KV_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]*")
_NO_EXTRAS = struct.pack("<I", 0)
# array("I") is the fastest way from a Python list to packed uint32 (3x numpy); it is native-endian.
if array("I").itemsize != 4:
    raise ImportError(f"array('I') is {array('I').itemsize} bytes here; block hashing needs 4-byte uint32")


def _u32(value: int, what: str) -> bytes:
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{what} = {value} does not fit in uint32")
    return struct.pack("<I", value)


def _lp(data: bytes, what: str) -> bytes:
    """Length-prefixed field: uint32 little-endian byte count, then the bytes."""
    return _u32(len(data), f"length of {what}") + data


def _check_hash(value: bytes, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise ValueError(f"{what} must be {HASH_SIZE} bytes, got {value!r}")


def canonical_config_json(config: Mapping[str, object]) -> bytes:
    """The config as the fingerprint sees it: JSON, sorted keys, no spaces, ASCII only, no NaN."""
    try:
        text = json.dumps(
            dict(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model config is not canonical-JSON serializable: {exc}") from exc
    return text.encode("ascii")


def model_fingerprint(
    config: Mapping[str, object], weights_identity: bytes, kv_dtype: str, block_size: int
) -> bytes:
    """32-byte fingerprint of what makes KV blocks interchangeable between nodes.

    config: ModelConfig.to_dict(); weights_identity: bytes naming the weights (a hash of checkpoint headers
    and sizes plus revision, or the dummy-weight seed); kv_dtype: a torch dtype name without the "torch."
    prefix ("bfloat16"); block_size: tokens per block. TP size and memory layout are deliberately not
    covered: the transfer handshake checks those.
    """
    if not isinstance(weights_identity, bytes):
        raise ValueError(f"weights_identity must be bytes, got {type(weights_identity).__name__}")
    if not _KV_DTYPE_RE.fullmatch(kv_dtype):
        raise ValueError(
            f"kv_dtype {kv_dtype!r} is not a dtype name like 'bfloat16' (drop any 'torch.' prefix)"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    payload = b"".join(
        (
            _lp(FINGERPRINT_TAG, "tag"),
            _lp(canonical_config_json(config), "config"),
            _lp(weights_identity, "weights_identity"),
            _lp(kv_dtype.encode("ascii"), "kv_dtype"),
            _u32(block_size, "block_size"),
        )
    )
    return hashlib.sha256(payload).digest()


def hash_seed(fingerprint: bytes, cache_salt: str | None) -> BlockHash:
    """h_{-1}: the parent of block 0 for one model fingerprint and one tenant salt (None = no salt)."""
    _check_hash(fingerprint, "fingerprint")
    salt = b"\x00" if cache_salt is None else b"\x01" + _lp(cache_salt.encode("utf-8"), "cache_salt")
    return BlockHash(hashlib.sha256(_lp(SEED_TAG, "tag") + fingerprint + salt).digest())


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as contiguous little-endian uint32; ValueError for ids outside [0, 2**32)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.size == 0:
            return b""
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi > _U32_MAX:
            raise ValueError(f"token id {lo if lo < 0 else hi} does not fit in uint32")
        return token_ids.astype("<u4", copy=False).tobytes()
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        bad = next(t for t in token_ids if not 0 <= t <= _U32_MAX)
        raise ValueError(f"token id {bad} does not fit in uint32") from exc
    except TypeError as exc:
        raise ValueError(f"token_ids must be integers: {exc}") from exc
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extras: Sequence[bytes] = ()) -> BlockHash:
    """One chained block hash: SHA-256(parent || u32 n || tokens || u32 m || m length-prefixed extras)."""
    _check_hash(parent, "parent")
    packed = pack_tokens(token_ids)
    parts = [parent, _u32(len(packed) // 4, "token count"), packed, _u32(len(extras), "extras count")]
    parts.extend(_lp(bytes(extra), "extra") for extra in extras)
    return BlockHash(hashlib.sha256(b"".join(parts)).digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    seed: BlockHash,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of full blocks start, start+1, ... of token_ids (a trailing partial block is not hashed).

    start is a block index: the caller already holds hashes of blocks [0, start) and passes the last of
    them as parent (required when start > 0, refused when start == 0, where the chain begins at seed).
    token_ids is the whole sequence; only tokens from start * block_size on are read.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if start == 0:
        if parent is not None:
            raise ValueError("parent must be None when start == 0: block 0 chains from the seed")
        prev = seed
    elif parent is None:
        raise ValueError(f"start = {start} needs parent = hash of block {start - 1}")
    else:
        prev = parent
    _check_hash(prev, "seed" if start == 0 else "parent")
    num_full = len(token_ids) // block_size
    if start >= num_full:
        return []
    packed = pack_tokens(token_ids[start * block_size : num_full * block_size])
    count = _u32(block_size, "block_size")
    stride = 4 * block_size
    sha256 = hashlib.sha256
    out: list[BlockHash] = []
    for offset in range(0, len(packed), stride):
        prev = BlockHash(sha256(prev + count + packed[offset : offset + stride] + _NO_EXTRAS).digest())
        out.append(prev)
    return out
