"""What a byte transport provides to the protocol code: dialing and listening.

A `Transport` hands out `ByteChannel`s (framing.py); the protocol itself is written once (sender.py,
receiver.py) and `ChannelConnector` (channel_connector.py) binds the two. Addresses are
`<scheme>://<host>:<port>`, the scheme being the connector kind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from pdserve.kvtransfer.framing import ByteChannel


class Listener(Protocol):
    @property
    def port(self) -> int: ...

    async def close(self) -> None: ...


class Transport(Protocol):
    scheme: str

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        """Raises ConnectionLost when the peer cannot be reached in time."""

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> Listener:
        """Serve each accepted connection with `on_channel`, which returns when the connection is over."""


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """`tcp://10.0.0.2:7001` -> ("10.0.0.2", 7001); the scheme must be this connector's."""
    prefix = f"{scheme}://"
    host, sep, port = address.removeprefix(prefix).rpartition(":")
    if not address.startswith(prefix) or not sep or not host or not port.isdigit():
        raise ValueError(f"bad transfer address {address!r}: expected {prefix}<host>:<port>")
    return host.strip("[]"), int(port)
