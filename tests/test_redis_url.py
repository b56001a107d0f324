"""The one Redis URL parser (shared/index/redis_url.py): Sentinel groups parsed, Redis Cluster refused with
its reason, passwords never in what messages print, and kvctl given a refused URL says so in one line."""

from __future__ import annotations

import pytest
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.index.redis_url import SentinelTarget, address, check_url, parse_sentinel
from pdserve.tests.harness.cluster_fixture import run_cli


def test_a_sentinel_url_names_its_sentinels_service_db_and_passwords() -> None:
    target = parse_sentinel("redis+sentinel://:s%40cret@h1:26379,h2:26380/mymaster/2?password=data")
    assert target == SentinelTarget((("h1", 26379), ("h2", 26380)), "mymaster", 2, "data", "s@cret")
    assert target.address == "redis+sentinel://h1:26379,h2:26380/mymaster/2"
    assert parse_sentinel("redis+sentinel://10.0.0.1:26379/m") == SentinelTarget((("10.0.0.1", 26379),), "m")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h:7000", "not supported"),
        ("memcached://h:1", "accepted redis://"),
        ("redis+sentinel://h:26379", "give the service"),
        ("redis+sentinel://h/mymaster", "is not host:port"),
        ("redis+sentinel://h:26379/mymaster/x", "must be a number"),
        ("redis+sentinel://h:26379/mymaster?pasword=x", "unknown parameter"),
    ],
)
def test_a_bad_url_is_refused_with_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_url(url)
    with pytest.raises(ValueError, match=says):
        RedisConfig(url=url)


def test_no_password_appears_where_the_address_is_printed() -> None:
    for url in ("redis+sentinel://:pw1@h:26379/m?password=pw2", "redis://:pw3@h:6379/0"):
        assert "pw" not in address(url) and "pw" not in RedisConfig(url=url).address
    with pytest.raises(ValueError) as refused:
        check_url("redis+sentinel://:pw4@h:26379/m/x?password=pw5")
    assert "pw" not in str(refused.value)


def test_kvctl_refuses_redis_cluster_in_one_line() -> None:
    done = run_cli("pdserve.kvctl.cli", "nodes", "--redis", "redis+cluster://127.0.0.1:7000", timeout_s=120)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and "redis+sentinel://" in done.stderr, done.stderr
