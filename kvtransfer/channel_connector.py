"""A registered `Connector` made of a byte `Transport` plus the one protocol implementation over channels.

The transport is built per config (`make_transport`), so a transport that needs the node's settings (the
device payloads land on, the payload timeout) gets them without the protocol code knowing about them.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    ConnectorOptions,
    KVReceiverServer,
    KVSender,
    TransferHandler,
)
from pdserve.kvtransfer.receiver import ChannelServer
from pdserve.kvtransfer.sender import ChannelSender
from pdserve.kvtransfer.transport import Transport


class ChannelConnector:
    def __init__(
        self,
        make_transport: Callable[[ConnectorConfig], Transport],
        checksum_default: bool | Callable[[ConnectorConfig], bool],
        options: type[ConnectorOptions] | None = None,
    ) -> None:
        self.make_transport = make_transport
        self.checksum_default = checksum_default
        self.options = options

    def default_checksum(self, config: ConnectorConfig) -> bool:
        if isinstance(self.checksum_default, bool):
            return self.checksum_default
        return self.checksum_default(config)

    def make_sender(self, config: ConnectorConfig, identity: PeerIdentity) -> KVSender:
        return ChannelSender(self.make_transport(config), config, identity)

    def make_server(
        self, config: ConnectorConfig, identity: PeerIdentity, handler: TransferHandler
    ) -> KVReceiverServer:
        return ChannelServer(self.make_transport(config), config, identity, handler)
