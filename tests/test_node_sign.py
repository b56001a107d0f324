"""shared/node/node_sign.py on a fake clock: a signed request verifies once, inside the window only, with the
same credential only, over exactly what was signed; the nonce cache forgets only what left the window and
refuses rather than forgets when full; the token never appears in what goes on the wire."""

from __future__ import annotations

import httpx2
import pytest
from pdserve.shared.node.node_sign import SCHEME, Claim, ClusterKeys, RequestVerifier, signed

KEYS = ClusterKeys("the-cluster-token")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def verify(
    v: RequestVerifier, header: str, method: str = "POST", target: bytes = b"/x?a=1", body: bytes = b"{}"
) -> str | None:
    claim = v.claim(header.encode())
    return claim if not isinstance(claim, Claim) else v.check(claim, method, target, body)


def test_a_request_verifies_once_and_only_as_signed() -> None:
    clock = Clock()
    v = RequestVerifier(KEYS, window_s=30, clock=clock)
    header = KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)
    assert header.startswith(SCHEME + " ") and "the-cluster-token" not in header
    assert verify(v, header) is None
    assert verify(v, header) == "nonce already used: a replayed request"
    fresh = KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)
    for method, target, body in (
        ("GET", b"/x?a=1", b"{}"),
        ("POST", b"/x?a=2", b"{}"),
        ("POST", b"/x?a=1", b"{1}"),
    ):
        assert "wrong signature" in str(verify(v, fresh, method, target, body))
    other = ClusterKeys("another-token").sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)
    assert "wrong signature" in str(verify(v, other))
    assert "no 'PDSERVE-HMAC-SHA256'" in str(verify(v, "Bearer the-cluster-token"))
    assert "malformed" in str(verify(v, f"{SCHEME} t=1,n=2"))


def test_the_clock_window_both_ways_and_the_cache_forgets_only_what_left_it() -> None:
    clock = Clock()
    v = RequestVerifier(KEYS, window_s=30, clock=clock)
    old = KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now - 31)
    ahead = KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now + 31)
    assert "outside the +-30s window" in str(verify(v, old))
    assert "outside the +-30s window" in str(verify(v, ahead))
    header = KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)
    assert verify(v, header) is None
    clock.now += 29
    assert verify(v, header) == "nonce already used: a replayed request"
    clock.now += 2  # the timestamp left the window: refused by the window, its nonce forgotten
    assert "outside" in str(verify(v, header))
    assert verify(v, KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)) is None
    assert header.split("n=")[1].split(",")[0] not in v._seen  # forgotten at the next check


def test_a_full_nonce_cache_refuses() -> None:
    clock = Clock()
    v = RequestVerifier(KEYS, window_s=30, max_nonces=2, clock=clock)
    for _ in range(2):
        assert verify(v, KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)) is None
    assert "refusing" in str(verify(v, KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)))
    clock.now += 31
    assert verify(v, KEYS.sign_request("POST", b"/x?a=1", b"{}", now_s=clock.now)) is None


def test_httpx_auth_signs_path_query_and_body() -> None:
    clock = Clock()
    request = httpx2.Request("POST", "http://node:1/internal/evict?x=%20y", content=b'{"all":true}')
    signed_request = next(signed("the-cluster-token").sync_auth_flow(request))
    header = signed_request.headers["authorization"]
    v = RequestVerifier(KEYS, window_s=10**9, clock=clock)
    assert verify(v, header, "POST", b"/internal/evict?x=%20y", b'{"all":true}') is None


def test_records_and_challenges_are_keyed_apart() -> None:
    parts = [b"d0", b"{}", b"1", b"{}"]
    sig = KEYS.sign_record(parts)
    assert KEYS.verify_record(parts, sig) and not KEYS.verify_record([b"d9", *parts[1:]], sig)
    assert not ClusterKeys("another-token").verify_record(parts, sig)
    assert not KEYS.verify_record(parts, "\u00e9" * 64)  # garbage from Redis is refused, never raised
    assert KEYS.challenge_answer("n", "d0", 1) != KEYS.challenge_answer("n", "d0", 2)
    with pytest.raises(ValueError):
        ClusterKeys("")
