"""The router's tenants: who a request's API key names, how fast that key may send, and the cache salt its
requests' blocks are hashed under.

Invariants: a key is accepted only as `Authorization: Bearer <key>`; keys are held as SHA-256 digests and
looked up by digest, never compared character by character. A tenant's cache salt always derives from its
key, and a client's `cache_salt` only narrows it (a hash of both), so two keys never share a block whatever
salts their clients send. Each key has one token bucket, made at start-up (memory does not grow with
traffic), that never holds more than `burst` tokens and refills at `per_second`; a request takes one token
or is refused with 429 and the seconds until one is there. Without configured keys there are no tenants:
any client is accepted, unlimited, and its own `cache_salt` (if any) is the salt.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.openai_protocol import OpenAIError


@dataclass(frozen=True)
class RateLimit:
    """A token bucket's shape: `per_second` requests sustained, `burst` at once (its size)."""

    per_second: float
    burst: int

    def __post_init__(self) -> None:
        if not self.per_second > 0 or not math.isfinite(self.per_second):
            raise ValueError(f"per_second must be a finite number > 0, got {self.per_second}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")


class TokenBucket:
    """Starts full. `take` is called from the event loop only (no lock)."""

    def __init__(self, limit: RateLimit, now: float) -> None:
        self.limit = limit
        self._tokens = float(limit.burst)
        self._at = now

    def take(self, now: float) -> float:
        """0.0 when a token was taken, else the seconds until one will be there (nothing is taken)."""
        rate, burst = self.limit.per_second, self.limit.burst
        self._tokens = min(float(burst), self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / rate


@dataclass(frozen=True)
class Tenant:
    salt: str
    """The key's own cache salt: 'key:' and the SHA-256 of the key."""


class Tenants:
    """The configured API keys, each with its tenant and (when `limit` is set) its bucket."""

    def __init__(
        self,
        api_keys: tuple[str, ...],
        limit: RateLimit | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._tenants: dict[bytes, Tenant] = {}
        self._buckets: dict[bytes, TokenBucket] = {}
        for key in api_keys:
            digest = hashlib.sha256(key.encode()).digest()
            self._tenants[digest] = Tenant("key:" + digest.hex())
            if limit is not None:
                self._buckets[digest] = TokenBucket(limit, clock())

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization` header's bearer key; None when no keys are configured.
        OpenAIError 401 for a missing header, another scheme, or an unknown key."""
        return self._lookup(authorization)[0]

    def admit(self, authorization: str | None) -> Tenant | None:
        """`authenticate`, then one token of the key's bucket: OpenAIError 429 with Retry-After (whole
        seconds, at least 1) when the key is over its rate."""
        tenant, bucket = self._lookup(authorization)
        wait = 0.0 if bucket is None else bucket.take(self._clock())
        if bucket is not None and wait > 0:
            limit = bucket.limit
            raise OpenAIError(
                429,
                f"Rate limit reached for this API key: {limit.per_second:g} requests/s with bursts of "
                f"{limit.burst}; retry in {wait:.2f} s",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"retry-after": str(max(1, math.ceil(wait)))},
            )
        return tenant

    def _lookup(self, authorization: str | None) -> tuple[Tenant | None, TokenBucket | None]:
        if not self._tenants:
            return None, None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        digest = hashlib.sha256(key.encode()).digest()
        tenant = self._tenants.get(digest) if scheme.lower() == "bearer" and key else None
        if tenant is None:
            raise OpenAIError(
                401,
                "Incorrect or missing API key: send it as the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return tenant, self._buckets.get(digest)


def cache_salt(tenant: Tenant | None, client_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed under: the tenant's, narrowed by the client's `cache_salt`
    (a hash of both, so it never equals another key's); the client's alone without tenants."""
    if tenant is None:
        return client_salt
    if client_salt is None:
        return tenant.salt
    both = b"".join(len(p).to_bytes(4, "little") + p for p in (tenant.salt.encode(), client_salt.encode()))
    return "key+salt:" + hashlib.sha256(both).hexdigest()
