"""Range checks for the config dataclasses' `__post_init__`, one wording for all: each raises ValueError
naming the config, the field and the value it got, so a bad setting says what to fix."""

from __future__ import annotations


def above(config: object, bound: float, *names: str) -> None:
    """Every field of `config` in `names` is > bound."""
    for name in names:
        value = getattr(config, name)
        if not value > bound:
            raise ValueError(f"{type(config).__name__}.{name} must be > {bound}, got {value!r}")


def at_least(config: object, bound: float, *names: str) -> None:
    """Every field of `config` in `names` is >= bound."""
    for name in names:
        value = getattr(config, name)
        if not value >= bound:
            raise ValueError(f"{type(config).__name__}.{name} must be >= {bound}, got {value!r}")


def port(config: object, name: str) -> None:
    """Field `name` of `config` is a TCP port, or 0 for a free one."""
    value = getattr(config, name)
    if not 0 <= value < 65536:
        raise ValueError(f"{type(config).__name__}.{name} must be in 0..65535 (0: a free one), got {value!r}")
