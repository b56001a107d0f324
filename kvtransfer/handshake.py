"""The handshake: identity and layout check, then mutual HMAC-SHA256 challenge-response.

Order: P HELLO(nonce_p) -> D HELLO(nonce_d, proof_d) -> P AUTH(proof_p) -> D READY. Each end checks the
other's version, model fingerprint and KV layout before any proof, refuses with an ERROR frame naming the
first difference, and raises `HandshakeError`. A proof is HMAC(token, label | role | nonce_p | nonce_d |
sender node | receiver node); the roles differ, so a proof cannot be reflected back, and the token itself
never crosses the wire. Until READY every frame is checksummed; afterwards the connection checksums if
either end's config asks for it. No frame before READY may carry a payload (framing refuses one from its
prefix), so an unauthenticated peer cannot make this end read more than a few KiB. Only after READY does
the transport set up its payload plane (`ByteChannel.authenticated`), so an unauthenticated peer never
gets a communicator.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
from collections.abc import AsyncIterator
from typing import TypeVar

from pdserve.kvtransfer.common import ConnectionLost, HandshakeError, PeerIdentity, ProtocolError
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.framing import FramedConnection, VersionMismatch
from pdserve.kvtransfer.messages import PROTOCOL_VERSION, Auth, Error, Hello, Message, Ready

NONCE_BYTES = 32
_LABEL = b"pdserve-kvtransfer-v1"
M = TypeVar("M", bound=Message)
_LINGER_S = 1.0  # how long a refusing end waits for the refused peer to read ERROR and hang up


def _proof(token: str, role: bytes, nonce_p: bytes, nonce_d: bytes, sender: str, receiver: str) -> bytes:
    parts = [_LABEL, role, nonce_p, nonce_d, sender.encode(), receiver.encode()]
    body = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hmac.new(token.encode(), body, hashlib.sha256).digest()


def _mismatch(mine: PeerIdentity, hello: Hello) -> tuple[str, str] | None:
    """(code, detail) of the first incompatibility between this end and the peer's HELLO."""
    if hello.version != PROTOCOL_VERSION:
        return "version", f"local v{PROTOCOL_VERSION}, peer v{hello.version}"
    if hello.fingerprint != mine.fingerprint:
        return "fingerprint", f"local {mine.fingerprint.hex()[:16]}.., peer {hello.fingerprint.hex()[:16]}.."
    difference = mine.layout.first_difference(hello.layout)
    if difference is not None:
        return "layout", f"layout.{difference}"
    if len(hello.nonce) != NONCE_BYTES:
        return "protocol", f"nonce must be {NONCE_BYTES} bytes, got {len(hello.nonce)}"
    return None


async def _refuse(conn: FramedConnection, code: str, detail: str) -> HandshakeError:
    """Tell the peer why, then linger until it hangs up (a transport whose connection is cut right after a
    send can drop the send), and build the local error. The peer may be gone already: the refusal stands
    either way."""
    try:
        await conn.send(Error(code, detail))
        async with asyncio.timeout(_LINGER_S):
            while True:
                await conn.recv()
    except (ConnectionLost, ProtocolError, TimeoutError):
        pass
    return HandshakeError(code, detail)


async def _expect(conn: FramedConnection, kind: type[M]) -> M:
    try:
        msg = (await conn.recv()).msg
    except VersionMismatch as e:
        raise await _refuse(conn, "version", f"local v{PROTOCOL_VERSION}, peer v{e.peer_version}") from e
    if isinstance(msg, Error):
        raise HandshakeError(msg.code, f"peer refused: {msg.detail}")
    if not isinstance(msg, kind):
        raise await _refuse(conn, "protocol", f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def _peer_hello(conn: FramedConnection, me: PeerIdentity) -> Hello:
    """The peer's HELLO; refused (HandshakeError, after ERROR) when its model or KV layout differs."""
    peer = await _expect(conn, Hello)
    problem = _mismatch(me, peer)
    if problem is not None:
        raise await _refuse(conn, *problem)
    return peer


async def _check_proof(conn: FramedConnection, expected: bytes, proof: bytes, who: str) -> None:
    """Refuses (HandshakeError `auth`, after ERROR) a peer whose HMAC proof is not the expected one."""
    if not hmac.compare_digest(expected, proof):
        raise await _refuse(conn, "auth", f"{who} failed the HMAC challenge (token differs)")


@contextlib.asynccontextmanager
async def _in_time(conn: FramedConnection, timeout_s: float) -> AsyncIterator[None]:
    """The handshake's time limit: past it, HandshakeError `timeout`."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise HandshakeError(
            "timeout", f"{conn.channel.peer} did not finish the handshake within {timeout_s}s"
        ) from None


async def client_handshake(conn: FramedConnection, config: ConnectorConfig, me: PeerIdentity) -> Hello:
    """P's side, within config.handshake_timeout_s; returns D's HELLO once D sent READY."""
    token = config.auth_token
    async with _in_time(conn, config.handshake_timeout_s):
        nonce_p = os.urandom(NONCE_BYTES)
        await conn.send(_hello(config, me, nonce_p, proof=b""))
        peer = await _peer_hello(conn, me)
        expected = _proof(token, b"receiver", nonce_p, peer.nonce, me.node_id, peer.node_id)
        await _check_proof(conn, expected, peer.proof, f"receiver {peer.node_id!r}")
        await conn.send(Auth(_proof(token, b"sender", nonce_p, peer.nonce, me.node_id, peer.node_id)))
        await _expect(conn, Ready)
        _authenticated(conn, config, peer)
        await conn.channel.authenticated()
    return peer


async def server_handshake(conn: FramedConnection, config: ConnectorConfig, me: PeerIdentity) -> Hello:
    """D's side, within config.handshake_timeout_s; returns P's HELLO after sending READY."""
    token = config.auth_token
    async with _in_time(conn, config.handshake_timeout_s):
        peer = await _peer_hello(conn, me)
        nonce_d = os.urandom(NONCE_BYTES)
        proof = _proof(token, b"receiver", peer.nonce, nonce_d, peer.node_id, me.node_id)
        await conn.send(_hello(config, me, nonce_d, proof))
        auth = await _expect(conn, Auth)
        expected = _proof(token, b"sender", peer.nonce, nonce_d, peer.node_id, me.node_id)
        await _check_proof(conn, expected, auth.proof, f"sender {peer.node_id!r}")
        await conn.send(Ready())
        _authenticated(conn, config, peer)
        await conn.channel.authenticated()
    return peer


def _hello(config: ConnectorConfig, me: PeerIdentity, nonce: bytes, proof: bytes) -> Hello:
    return Hello(
        PROTOCOL_VERSION, me.node_id, me.fingerprint, me.layout, nonce, config.frame_checksum, proof,
        config.liveness_s,
    )  # fmt: skip


def _authenticated(conn: FramedConnection, config: ConnectorConfig, peer: Hello) -> None:
    """Either end after READY: the connection checksums if either end asks, and knows the peer's liveness."""
    conn.authenticated = True
    conn.checksum = config.frame_checksum or peer.checksum
    conn.peer_liveness_s = peer.liveness_s
