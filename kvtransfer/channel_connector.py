"""A registered `Connector` made of a byte `Transport` plus the one protocol implementation over channels."""

from __future__ import annotations

from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.connector import ConnectorConfig, KVReceiverServer, KVSender, TransferHandler
from pdserve.kvtransfer.receiver import ChannelServer
from pdserve.kvtransfer.sender import ChannelSender
from pdserve.kvtransfer.transport import Transport


class ChannelConnector:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def make_sender(self, config: ConnectorConfig, identity: PeerIdentity) -> KVSender:
        return ChannelSender(self.transport, config, identity)

    def make_server(
        self, config: ConnectorConfig, identity: PeerIdentity, handler: TransferHandler
    ) -> KVReceiverServer:
        return ChannelServer(self.transport, config, identity, handler)
