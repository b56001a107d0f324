"""The ACK doorbell (kvtransfer/doorbell.py): keys, rings seen through a second, read-only mapping, files."""

from __future__ import annotations

import os

import pytest
from pdserve.kvtransfer.doorbell import (
    DOORBELL_BYTES,
    NAME_BYTES,
    SHM_DIR,
    SLOTS,
    Doorbell,
    SharedFile,
    ack_key,
    open_shared,
)

PREFIX = "pdserve-test-bell-"


def test_a_ring_is_seen_through_the_peers_read_only_mapping() -> None:
    shared = SharedFile(PREFIX, 8 + DOORBELL_BYTES)
    reader_map = open_shared(PREFIX, shared.token, 8 + DOORBELL_BYTES)
    assert reader_map is not None
    shared.unlink()  # the mappings outlive the name
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    writer, reader = Doorbell(shared.mapping, 8), Doorbell(reader_map, 8)
    key = ack_key("req-1", 1234.5)
    assert not reader.rung(key)
    writer.ring(key)
    assert reader.rung(key)
    assert shared.mapping[:8] == bytes(8), "the doorbell stays clear of what precedes it"
    with pytest.raises(TypeError):
        reader_map[8:16] = bytes(8)  # P cannot ring D's doorbell
    reader_map.close()
    shared.mapping.close()


def test_keys_tell_apart_transfers_and_retries_of_one_transfer() -> None:
    assert ack_key("req-1", 100.0) == ack_key("req-1", 100.0)
    assert len({ack_key("req-1", 100.0), ack_key("req-1", 100.5), ack_key("req-2", 100.0)}) == 3
    shared = SharedFile(PREFIX, DOORBELL_BYTES)
    shared.unlink()
    bell = Doorbell(shared.mapping, 0)
    bell.ring(ack_key("req-1", 100.0))
    assert not bell.rung(ack_key("req-1", 100.5)), "a retry under the same id must not see the old ring"
    shared.mapping.close()


def test_only_whole_slots_match_and_old_rings_roll_off() -> None:
    shared = SharedFile(PREFIX, DOORBELL_BYTES)
    shared.unlink()
    bell = Doorbell(shared.mapping, 0)
    keys = [ack_key(f"req-{i}", 1.0) for i in range(SLOTS + 1)]
    bell.ring(keys[0])
    straddling = keys[0][4:] + keys[1][:4]
    bell.ring(keys[1])
    assert not bell.rung(straddling), "bytes across two slots are no key"
    for key in keys[2:]:
        bell.ring(key)
    assert not bell.rung(keys[0]), "SLOTS later rings overwrote the first"
    assert all(bell.rung(key) for key in keys[1:])
    shared.mapping.close()


def test_a_file_on_another_host_is_absent_and_a_bad_token_is_refused() -> None:
    assert open_shared(PREFIX, os.urandom(NAME_BYTES), DOORBELL_BYTES) is None
    with pytest.raises(ValueError, match="16 bytes"):
        open_shared(PREFIX, b"../../etc", DOORBELL_BYTES)
    shared = SharedFile(PREFIX, 8)
    try:
        with pytest.raises(ValueError, match="smaller"):
            open_shared(PREFIX, shared.token, DOORBELL_BYTES)
    finally:
        shared.unlink()
        shared.mapping.close()
