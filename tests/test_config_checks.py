"""The config dataclasses refuse an out-of-range setting by naming the config, the field and the value
(shared/checks.py's one wording), whichever process's config it is."""

from __future__ import annotations

from typing import Any

import pytest
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.router.config import RouterConfig
from pdserve.shared.index.block_index_types import RedisConfig


def router(**bad: Any) -> RouterConfig:
    return RouterConfig(model_path="m", served_model_name="m", redis=RedisConfig(), node_token="t", **bad)


@pytest.mark.parametrize(
    ("make", "bad", "message"),
    [
        (router, {"port": 70000}, "RouterConfig.port must be in 0..65535 (0: a free one), got 70000"),
        (router, {"node_list_ttl_s": 0.0}, "RouterConfig.node_list_ttl_s must be > 0, got 0.0"),
        (router, {"migration_limit": -1}, "RouterConfig.migration_limit must be >= 0, got -1"),
        (router, {"max_n": 0}, "RouterConfig.max_n must be >= 1, got 0"),
        (
            lambda **bad: ConnectorConfig(kind="tcp", auth_token="t", **bad),
            {"liveness_s": -1.0},
            "ConnectorConfig.liveness_s must be > 0, got -1.0",
        ),
    ],
)
def test_a_bad_setting_is_refused_by_name(make: Any, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        make(**bad)
    assert str(err.value) == message
    make()  # the same config with the setting left at its default is fine
