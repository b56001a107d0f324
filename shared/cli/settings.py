"""One configuration per process, from flags, the environment or a TOML file, validated once.

Each process declares its settings as one pydantic model (a `Settings` subclass): a field `foo_bar` is the
flag `--foo-bar`, the variable `PDSERVE_FOO_BAR` and the key `foo_bar` of the file given with `--config`.
Invariants: precedence is flag > environment > file > default, decided here only; the click options are
generated from the model (help = the field's description, default shown), so help and validation never
drift apart; a secret is never a setting (no flag exists for it): it comes from `PDSERVE_<NAME>` or the
file named by `PDSERVE_<NAME>_FILE`. Only CLI entry points call this module; it imports nothing heavy, so
`--help` answers without torch.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import click
from click.core import ParameterSource
from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

if TYPE_CHECKING:
    from pdserve.shared.index.block_index_types import RedisConfig

ENV_PREFIX = "PDSERVE_"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")

S = TypeVar("S", bound="Settings")
F = TypeVar("F", bound=Callable[..., Any])


class SettingsError(Exception):
    """A setting or a secret is missing or invalid; the message is one line naming it and its source."""


class StartupError(Exception):
    """A process could not start (model unreadable, refused by the cluster); the message is one line."""


class Settings(BaseSettings):
    """Base of every process's settings: PDSERVE_-prefixed environment, unknown file keys refused."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)


def _comma_split(value: object) -> object:
    """A comma-separated string (flag, variable) or a list (TOML; repeated flag) of comma-separated items."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple):
        return tuple(n.strip() for v in value for n in str(v).split(",") if n.strip())
    return value


CommaList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_comma_split)]
"""A list setting: `--x a,b` or `--x a --x b`, `PDSERVE_X=a,b`, or `x = ["a", "b"]` in the file."""

LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(lambda v: str(v).upper())]


class RedisAccess(Settings):
    """How a process reaches the cluster's Redis besides its URL (whose default differs per process: required
    for a router, none for a node, the running `pdserve up`'s for kvctl): the password, read from a file or
    the environment and never from argv, and the CA bundle of a rediss:// server."""

    redis_password_file: str | None = Field(
        None, description="file holding the Redis password (else PDSERVE_REDIS_PASSWORD is read)"
    )
    tls_ca_file: str | None = Field(None, description="CA bundle to verify a rediss:// server")

    def redis_password(self) -> str | None:
        """The password; None when neither its file nor PDSERVE_REDIS_PASSWORD gives one."""
        return read_secret("redis_password", "the Redis password", self.redis_password_file, required=False)

    def redis_config(self, url: str, cluster: str) -> RedisConfig:
        """The index's client settings for `url` and the `cluster` key prefix; SettingsError when the
        password's file cannot be read, ValueError when the URL is malformed."""
        from pdserve.shared.index.block_index_types import RedisConfig

        password = self.redis_password()
        return RedisConfig(url=url, password=password, cluster=cluster, tls_ca_file=self.tls_ca_file)


class ClusterCredential(RedisAccess):
    """What every process that signs calls to the nodes or verifies their records takes: the cluster's
    token."""

    auth_token_file: str | None = Field(
        None,
        description="file holding the cluster's KV-transfer token, the credential of the transfers and of "
        "every internal call between router and nodes (else PDSERVE_AUTH_TOKEN is read; required)",
    )

    def auth_token(self) -> str:
        """The token; SettingsError when neither its file nor PDSERVE_AUTH_TOKEN gives one."""
        token = read_secret(
            "auth_token", "the cluster's KV-transfer token", self.auth_token_file, required=True
        )
        assert token is not None  # required=True
        return token


class ClusterMember(ClusterCredential):
    """What a router and a node both take: the Redis access, the cluster's token and the collector their
    request spans go to."""

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP collector URL (e.g. http://127.0.0.1:4318) the request spans are exported to "
        "(default: OTEL_EXPORTER_OTLP_ENDPOINT if set; else no tracing)",
    )

    def trace_endpoint(self) -> str | None:
        """The collector: the setting, else the standard OpenTelemetry variable; None: not traced."""
        return self.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def flag_name(field: str, cls: type[Settings] | None = None) -> str:
    """`--foo-bar` for the field `foo_bar`, or the flag it names (json_schema_extra={"flag": ...})."""
    extra = (
        cls.model_fields[field].json_schema_extra if cls is not None and field in cls.model_fields else None
    )
    if isinstance(extra, dict) and isinstance(extra.get("flag"), str):
        return str(extra["flag"])
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def load_settings(cls: type[S], flags: Mapping[str, Any], config_file: str | None) -> S:
    """The validated settings: `flags` (only those given on the command line) over the environment over
    the TOML file over the defaults. Raises SettingsError naming the first bad value and its source."""
    file_values: dict[str, Any] = {}
    if config_file:
        if not os.path.isfile(config_file):
            raise SettingsError(f"--config {config_file}: no such file")
        try:
            file_values = TomlConfigSettingsSource(cls, toml_file=config_file)()
        except ValueError as exc:  # tomllib.TOMLDecodeError
            raise SettingsError(f"--config {config_file}: not valid TOML ({exc})") from exc
    env_values = EnvSettingsSource(cls)()
    origin = {k: f"key {k!r} of {config_file}" for k in file_values}
    origin |= {k: env_name(k) for k in env_values} | {k: flag_name(k, cls) for k in flags}
    try:
        return cls.model_validate({**file_values, **env_values, **flags})
    except ValidationError as exc:
        errors = exc.errors()
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        key = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "missing":
            raise SettingsError(
                f"{flag_name(key, cls)} is required (or set {env_name(key)}, or `{key}` in --config)"
            ) from exc
        if err["type"] == "extra_forbidden":
            raise SettingsError(f"{origin.get(key, key)}: unknown setting {key!r}") from exc
        where = origin.get(key, flag_name(key, cls))
        raise SettingsError(f"{where}={err.get('input')!r}: {err['msg']}") from exc


def read_secret(name: str, what: str, file_path: str | None, *, required: bool) -> str | None:
    """A secret from `file_path` (the setting `<name>_file`: --<name>-file or PDSERVE_<NAME>_FILE), else from
    the variable PDSERVE_<NAME>; never from argv. Surrounding whitespace (a trailing newline) is dropped."""
    var = env_name(name)
    if file_path:
        try:
            with open(file_path, encoding="utf-8") as f:
                value: str | None = f.read().strip()
        except OSError as exc:
            raise SettingsError(f"{var}_FILE={file_path}: cannot read {what} ({exc.strerror})") from exc
        if not value:
            raise SettingsError(f"{var}_FILE={file_path}: the file is empty; it must hold {what}")
    else:
        value = os.environ.get(var) or None
    if value is None and required:
        raise SettingsError(f"{what} is missing: set {var} (or {var}_FILE, a file holding it)")
    return value


def chat_template_text(value: str | None) -> str | None:
    """The `--chat-template` setting (router, nodes, generate, kvctl): a file holding a Jinja chat template,
    or the template itself; None keeps the model's. SettingsError when it is neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise SettingsError(
        f"--chat-template {value[:60]!r}: neither a file nor a Jinja template ({{{{ }}}}, {{% %}})"
    )


def check_model_path(model: str, flag: str = "--model") -> str:
    """The model argument, or SettingsError when it names nothing on disk (a hub id gets download advice)."""
    if model.startswith("dummy:") or os.path.exists(model):
        return model
    if _HUB_ID.fullmatch(model):
        raise SettingsError(
            f"{flag} {model}: no such file or directory; pdserve loads local files only: if this is a "
            f"Hugging Face hub id, download it first (`hf download {model} --local-dir DIR`) and pass "
            f"{flag} DIR"
        )
    raise SettingsError(f"{flag} {model}: no such file or directory")


def _click_type(annotation: Any) -> tuple[Any, bool]:
    """(click type, multiple) of a field's annotation; Optional is unwrapped."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _click_type(inner[0])
    if origin is Literal:
        return click.Choice([str(a) for a in get_args(annotation)], case_sensitive=False), False
    if origin is tuple:
        return _click_type(get_args(annotation)[0])[0], True
    return {int: click.INT, float: click.FLOAT, str: click.STRING}.get(annotation, click.STRING), False


def _show_default(value: Any) -> str | bool:
    if value is None or value == "":
        return False
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else False
    return str(value).lower() if isinstance(value, bool) else str(value)


def click_options(cls: type[Settings], *, hidden: frozenset[str] = frozenset()) -> Callable[[F], F]:
    """Decorator adding one click option per field of `cls` (fields in `hidden` get none) and `--config`."""

    def decorate(fn: F) -> F:
        for name, field in reversed(list(cls.model_fields.items())):
            if name in hidden:
                continue
            help_text = (field.description or "").strip()
            help_text += f" [env: {env_name(name)}]"
            default = field.default if not field.is_required() else None
            flag = flag_name(name, cls)
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            aliases = [str(a) for a in extra.get("aliases", ())]  # type: ignore[union-attr]
            if field.annotation is bool:
                decls = [flag] + ([f"--no-{flag[2:]}"] if default else [])
                option = click.option(
                    "/".join(decls) if default else decls[0],
                    name,
                    is_flag=True,
                    default=bool(default),
                    show_default=True,
                    help=help_text,
                )
            else:
                ctype, multiple = _click_type(field.annotation)
                shown = "required" if field.is_required() else _show_default(default)
                option = click.option(
                    flag,
                    *aliases,
                    name,
                    type=ctype,
                    multiple=multiple,
                    default=None,
                    show_default=shown,
                    help=help_text,
                )
            fn = option(fn)
        config = click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            envvar=ENV_PREFIX + "CONFIG",
            show_envvar=True,
            help="TOML file of settings (keys are the option names with underscores); "
            "flags and PDSERVE_* variables override it",
        )
        return config(fn)

    return decorate


def given_flags(ctx: click.Context, cls: type[Settings], values: Mapping[str, Any]) -> dict[str, Any]:
    """The values of `cls`'s fields that were given on the command line (not click's defaults)."""
    out = {}
    for name in cls.model_fields:
        if name in values and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            value = values[name]
            if isinstance(value, tuple) and not value:
                continue
            out[name] = value
    return out


def settings_from_click(cls: type[S], ctx: click.Context, values: Mapping[str, Any]) -> S:
    """`load_settings` for a click command decorated with `click_options(cls)`."""
    return load_settings(cls, given_flags(ctx, cls, values), values.get("config_file"))
