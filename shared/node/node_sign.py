"""Every MAC the cluster's credential makes outside the KV-transfer handshake: signed internal HTTP requests
(router -> node, kvctl -> node, node -> node), signed node records in the Redis index, and the answer a node
gives to a router's challenge of its URL.

Invariants:
- The cluster token never leaves the process and is never a MAC key itself: each use has its own key,
  HMAC-SHA256(token, domain label), so a MAC of one kind is of no use as another.
- A signed request covers (method, path with query, timestamp, nonce, SHA-256 of the body); a verifier
  accepts it only within `window_s` of its own clock and only once (its nonce is remembered until the
  timestamp leaves the window; the cache is bounded and refuses rather than forgets when full).
- A record signature covers the node id, the registration JSON as Redis stores it, the epoch and the load
  JSON (which carries the drain flag): what the router acts on is what the node signed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import httpx2

SCHEME = "PDSERVE-HMAC-SHA256"
"""The `Authorization` scheme of a signed request: `PDSERVE-HMAC-SHA256 t=<unix ms>,n=<32 hex>,s=<64 hex>`."""

_REQUEST_LABEL = b"pdserve node request v1"
_RECORD_LABEL = b"pdserve node record v1"
_CHALLENGE_LABEL = b"pdserve node challenge v1"


def _mac(key: bytes, parts: Sequence[bytes]) -> str:
    """HMAC-SHA256 of length-prefixed parts (no part can run into the next)."""
    m = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        m.update(len(part).to_bytes(8, "big"))
        m.update(part)
    return m.hexdigest()


class ClusterKeys:
    """The keys one cluster token yields; the token itself is not kept."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the cluster's credential (PDSERVE_AUTH_TOKEN) must be a non-empty token")
        raw = token.encode()
        self._request = hmac.new(raw, _REQUEST_LABEL, hashlib.sha256).digest()
        self._record = hmac.new(raw, _RECORD_LABEL, hashlib.sha256).digest()
        self._challenge = hmac.new(raw, _CHALLENGE_LABEL, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ClusterKeys(<secret>)"

    def request_mac(self, method: str, target: bytes, ts_ms: int, nonce: str, body: bytes) -> str:
        digest = hashlib.sha256(body).digest()
        return _mac(
            self._request, [method.upper().encode(), target, str(ts_ms).encode(), nonce.encode(), digest]
        )

    def sign_request(self, method: str, target: bytes, body: bytes, now_s: float | None = None) -> str:
        """The `Authorization` header value of a request to `target` (path and query, as sent)."""
        ts_ms = int(1000 * (time.time() if now_s is None else now_s))
        nonce = secrets.token_hex(16)
        return f"{SCHEME} t={ts_ms},n={nonce},s={self.request_mac(method, target, ts_ms, nonce, body)}"

    def sign_record(self, parts: Sequence[bytes]) -> str:
        """64 hex digits over a node record's parts (block_index.py names them)."""
        return _mac(self._record, parts)

    def verify_record(self, parts: Sequence[bytes], signature: str) -> bool:
        return hmac.compare_digest(self.sign_record(parts).encode(), signature.encode())

    def challenge_answer(self, nonce: str, node_id: str, epoch: int) -> str:
        """What the node registered as (node_id, epoch) answers to a router's challenge `nonce`."""
        return _mac(self._challenge, [nonce.encode(), node_id.encode(), str(epoch).encode()])


class SignedRequests(httpx2.Auth):
    """httpx2 auth that signs every request with the cluster's request key: `httpx2.AsyncClient(auth=...)`."""

    requires_request_body = True

    def __init__(self, keys: ClusterKeys) -> None:
        self._keys = keys

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["authorization"] = self._keys.sign_request(
            request.method, request.url.raw_path, request.content
        )
        yield request


def signed(token: str) -> SignedRequests:
    """The auth a client of a node's internal API passes to httpx2 (tests and tools hold only the token)."""
    return SignedRequests(ClusterKeys(token))


@dataclass(frozen=True)
class Claim:
    """A signed request's header, parsed and inside the clock window; its MAC is not checked yet."""

    ts_ms: int
    nonce: str
    mac: str


class RequestVerifier:
    """A node's check of signed requests: the clock window and the replay cache (one per node process)."""

    def __init__(
        self,
        keys: ClusterKeys,
        window_s: float = 30.0,
        max_nonces: int = 1_000_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0 or max_nonces < 1:
            raise ValueError(f"window_s={window_s}, max_nonces={max_nonces}: must be positive")
        self._keys = keys
        self._window_ms = int(window_s * 1000)
        self._max = max_nonces
        self._clock = clock
        self._seen: dict[str, int] = {}
        """nonce -> unix ms after which its timestamp is outside the window (insertion order)."""

    def claim(self, header: bytes) -> Claim | str:
        """The parsed header, or why it is refused (format, clock window): checked before any body is read."""
        text = header.decode("latin-1")
        scheme, _, params = text.partition(" ")
        if scheme != SCHEME:
            return f"no '{SCHEME}' authorization: sign the request with the cluster's credential"
        fields = dict(p.split("=", 1) for p in params.split(",") if "=" in p)
        try:
            ts_ms, nonce, mac = int(fields["t"]), fields["n"], fields["s"]
        except (KeyError, ValueError):
            return "malformed signature parameters: need t=<unix ms>,n=<nonce>,s=<mac>"
        if not 16 <= len(nonce) <= 64 or len(mac) != 64:
            return "malformed nonce or mac"
        skew_ms = int(self._clock() * 1000) - ts_ms
        if abs(skew_ms) > self._window_ms:
            return (
                f"timestamp {skew_ms / 1000:+.1f}s off this node's clock, outside the +-"
                f"{self._window_ms / 1000:.0f}s window: a replay, or clocks that need syncing (NTP)"
            )
        return Claim(ts_ms, nonce, mac)

    def check(self, claim: Claim, method: str, target: bytes, body: bytes) -> str | None:
        """None if the MAC matches and the nonce is new (it is then remembered), else why not."""
        expected = self._keys.request_mac(method, target, claim.ts_ms, claim.nonce, body)
        if not hmac.compare_digest(expected, claim.mac):
            return "wrong signature: the cluster's credential differs, or the request was altered"
        now_ms = int(self._clock() * 1000)
        # Roughly in expiry order (timestamps are near the clock): forget from the front while expired; one
        # out of order only stays longer, which is safe.
        while self._seen:
            first = next(iter(self._seen))
            if self._seen[first] >= now_ms:
                break
            del self._seen[first]
        if claim.nonce in self._seen:
            return "nonce already used: a replayed request"
        if len(self._seen) >= self._max:
            return f"{self._max} signed requests inside the window: refusing until some leave it"
        self._seen[claim.nonce] = claim.ts_ms + self._window_ms
        return None
