"""Shared memory between the two ends of a same-host connection: the files, and the ACK doorbell in them.

A GPU connection whose ends share a host (cuda_ipc always; nccl over NVLink usually) gets a small file in
/dev/shm that D creates and P maps read-only. cuda_ipc keeps its progress counter there; both keep a
doorbell: as D acknowledges a transfer, it writes the transfer's key into the doorbell just before the ACK
frame leaves, and P, which spins for the ACK anyway (sender.py), finds the key there without waiting for
the frame (what the frame costs: docs/kv_transfer_protocol.md, "ACK doorbell"); the doorbell is seen
within one turn of P's loop. The ACK frame stays the protocol's answer: across hosts it is the only one,
and P drops it when the doorbell came first.

Layout: SLOTS slots of 8 bytes; D writes each key into the next slot, round robin; P looks for its key
in every slot (`mmap.find`, a few hundred nanoseconds). A key is 8 bytes of BLAKE2b over the transfer id
and the OPEN's deadline, so a retried transfer under the same id (a new deadline) never matches an
earlier ring.

Invariants: D rings only after `on_complete` succeeded (what an ACK promises); a slot is overwritten only
by a newer ring, so P misses a ring only after SLOTS later ones, and then takes the ACK frame; a torn read
of a slot being written cannot match a key other than the one being written (that needs 8 random bytes to
line up); files are created mode 0600 under random names and unlinked by D once P mapped them (or at D's
teardown), so none stays behind in /dev/shm.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os

SHM_DIR = "/dev/shm"
SLOTS = 64
SLOT_BYTES = 8
DOORBELL_BYTES = SLOTS * SLOT_BYTES
NAME_BYTES = 16  # random bytes of a file's name, sent to P in hex


def ack_key(transfer_id: str, deadline: float) -> bytes:
    """The doorbell key of one transfer (D and P compute it alike from OPEN's fields)."""
    return hashlib.blake2b(f"{transfer_id}\0{deadline!r}".encode(), digest_size=SLOT_BYTES).digest()


class SharedFile:
    """D's end of a shared file, created at once under a random name (`token`), unlinked once P mapped it
    (or at teardown); whoever holds `mapping` closes it."""

    def __init__(self, prefix: str, size: int) -> None:
        self.token = os.urandom(NAME_BYTES)
        self._path: str | None = os.path.join(SHM_DIR, prefix + self.token.hex())
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid); idempotent."""
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None


def open_shared(prefix: str, token: bytes, size: int) -> mmap.mmap | None:
    """P's read-only mapping of D's file `token`, or None when the file is not on this host."""
    if len(token) != NAME_BYTES:
        raise ValueError(f"a shared-memory token has {NAME_BYTES} bytes, got {len(token)}")
    try:
        fd = os.open(os.path.join(SHM_DIR, prefix + token.hex()), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shared-memory file {prefix + token.hex()} is smaller than {size} B")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


class Doorbell:
    """The doorbell at `offset` of a mapping (its owner keeps it open while this is used): D rings it, P
    reads it."""

    def __init__(self, mapping: mmap.mmap, offset: int) -> None:
        self._mapping = mapping
        self._start = offset
        self._next = 0

    def ring(self, key: bytes) -> None:
        at = self._start + self._next * SLOT_BYTES
        self._mapping[at : at + SLOT_BYTES] = key
        self._next = (self._next + 1) % SLOTS

    def rung(self, key: bytes) -> bool:
        end = self._start + DOORBELL_BYTES
        at = self._mapping.find(key, self._start, end)
        while at >= 0:
            if (at - self._start) % SLOT_BYTES == 0:
                return True
            at = self._mapping.find(key, at + 1, end)
        return False
