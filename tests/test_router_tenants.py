"""router/tenants.py on a fake clock: the token bucket's invariants, bearer-only keys, and salts that never
let two keys meet."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.tenants import RateLimit, Tenants, TokenBucket, cache_salt


@given(
    rate=st.floats(0.1, 100),
    burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=60),
)
def test_a_bucket_admits_at_most_burst_plus_rate_times_elapsed(
    rate: float, burst: int, gaps: list[float]
) -> None:
    bucket = TokenBucket(RateLimit(rate, burst), now=0.0)
    now, admitted = 0.0, 0
    for gap in gaps:
        now += gap
        wait = bucket.take(now)
        if wait == 0.0:
            admitted += 1
        else:
            assert 0 < wait <= 1 / rate + 1e-9
            assert bucket.take(now + wait + 1e-9) == 0.0  # the promised wait is enough
            admitted += 1
            now += wait + 1e-9
        assert admitted <= burst + rate * now + 1e-6


def test_keys_are_bearer_only_and_limited_per_key() -> None:
    clock = [0.0]
    tenants = Tenants(("k1", "k2"), RateLimit(1.0, 2), clock=lambda: clock[0])
    for header in (None, "k1", "Basic k1", "Bearer", "Bearer k3", "Bearerk1"):
        with pytest.raises(OpenAIError) as err:
            tenants.admit(header)
        assert err.value.status == 401
    assert tenants.admit("Bearer k1") == tenants.admit("bearer  k1 ")
    with pytest.raises(OpenAIError) as err:
        tenants.admit("Bearer k1")
    assert err.value.status == 429 and err.value.headers == {"retry-after": "1"}
    assert tenants.admit("Bearer k2") is not None  # its own bucket
    clock[0] = 1.0
    assert tenants.admit("Bearer k1") is not None
    assert Tenants((), None).admit(None) is None


def test_a_client_salt_narrows_its_keys_salt_and_never_replaces_it() -> None:
    tenants = Tenants(("k1", "k2"), None)
    a, b = tenants.authenticate("Bearer k1"), tenants.authenticate("Bearer k2")
    salts = {cache_salt(t, s) for t in (a, b) for s in (None, "shared", "")}
    assert len(salts) == 6
    assert cache_salt(None, "shared") == "shared" and cache_salt(None, None) is None
    assert a is not None and cache_salt(a, None) == a.salt and "shared" not in salts
