"""The one parser of a Redis URL and the one factory of Redis clients, for every process that takes `--redis`
(router, nodes, kvctl, benchmarks): one server (`redis://`, `rediss://`, `unix://`) or a Sentinel group.

`redis+sentinel://[:sentinel-password@]host:port[,host:port...]/service[/db][?password=...]`: the client asks
the sentinels (in the order given, the first that answers) for the primary of `service`, and asks again
whenever a connection to it fails or the server it reaches says it became a replica, so a failover costs a
few failed calls, never a restart. `?password=` is the data servers' password (a `--redis-password-file` or
PDSERVE_REDIS_PASSWORD wins over it); the userinfo's password is the sentinels' own (`requirepass` in a
sentinel's config), which is often none.
`redis+cluster://` is refused: pdserve needs one primary that holds every key of a cluster
(docs/redis_index.md says why); a Sentinel group gives the failover that Redis Cluster would.
Nothing here does I/O but the clients it returns, which connect lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    import redis.asyncio as aioredis

SENTINEL_SCHEME = "redis+sentinel"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
_ACCEPTED = "redis://, rediss://, unix:// or redis+sentinel://host:port[,host:port]/service"


@dataclass(frozen=True)
class SentinelTarget:
    """A Sentinel group and the service (master name) whose primary holds the index."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None
    """The data servers' password (`?password=`)."""
    sentinel_password: str | None = None
    """The sentinels' own password (the URL's userinfo)."""

    @property
    def address(self) -> str:
        """For messages: never contains a password."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{hosts}/{self.service}/{self.db}"


def check_url(url: str) -> None:
    """ValueError (one line naming the URL's fault and what is accepted) unless `url` can be connected to."""
    scheme = urlsplit(url).scheme
    if scheme == "redis+cluster" or scheme == "rediss+cluster":
        raise ValueError(
            f"{scheme}:// is not supported: pdserve's index scripts need one primary holding every key; "
            "for failover use redis+sentinel://host:26379/mymaster (docs/redis_index.md)"
        )
    if scheme not in SCHEMES:
        raise ValueError(f"Redis URL scheme {scheme!r}: accepted {_ACCEPTED}")
    if scheme == SENTINEL_SCHEME:
        parse_sentinel(url)


def parse_sentinel(url: str) -> SentinelTarget:
    """The Sentinel group a `redis+sentinel://` URL names; ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"{url.split('://')[0]}:// is not {SENTINEL_SCHEME}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(h, url) for h in hosts.split(","))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"{_safe(url)}: give the service (master name) as the path: .../mymaster[/db]")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"{_safe(url)}: the database after the service must be a number, got {path[1]!r}")
    query = parse_qs(parts.query)
    unknown = set(query) - {"password"}
    if unknown:
        raise ValueError(f"{_safe(url)}: unknown parameter(s) {sorted(unknown)}; accepted: password")
    sentinel_password = unquote(userinfo.partition(":")[2]) if userinfo else None
    password = query["password"][-1] if "password" in query else None
    db = int(path[1]) if len(path) == 2 else 0
    return SentinelTarget(sentinels, unquote(path[0]), db, password or None, sentinel_password or None)


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, _, port = item.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{_safe(url)}: sentinel {item!r} is not host:port")
    return host.strip("[]"), int(port)


def _safe(url: str) -> str:
    """The URL without its query or userinfo (where passwords are)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def address(url: str) -> str:
    """Where a URL points, for messages: never contains a password."""
    parts = urlsplit(url)
    if parts.scheme == SENTINEL_SCHEME:
        return parse_sentinel(url).address
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def sentinel_client(
    target: SentinelTarget, password: str | None, username: str | None, common: dict[str, Any]
) -> aioredis.Redis:
    """A client of the target's current primary (redis-py's Sentinel): it asks the sentinels again whenever
    its connection fails, so it follows a failover. `common`: the connection settings of every client."""
    from redis.asyncio.sentinel import Sentinel

    sentinel_kwargs = {
        "password": target.sentinel_password,
        "socket_timeout": common["socket_timeout"],
        "socket_connect_timeout": common["socket_connect_timeout"],
    }
    group = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    data = {**common, "username": username, "password": password or target.password, "db": target.db}
    return group.master_for(target.service, **data)
