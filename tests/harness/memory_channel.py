"""A ByteChannel without a transport, for the framing codec's tests: what a channel needs besides its bytes
(a peer name, a liveness clock, set-up and tear-down) done once; a subclass says where `send` puts the
bytes and where `recv_exact` takes them from."""

from __future__ import annotations

import torch
from pdserve.kvtransfer.framing import ByteChannel


class InMemoryChannel(ByteChannel):
    peer_name = "memory"

    @property
    def peer(self) -> str:
        return self.peer_name

    @property
    def heard_at(self) -> float:
        return 0.0

    async def authenticated(self) -> None:
        return None

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(await self.recv_exact(nbytes)), dtype=torch.uint8)

    def abort(self) -> None:
        return None

    async def close(self) -> None:
        return None
