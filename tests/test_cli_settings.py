"""The operator's command lines: every `pdserve` and `kvctl` command's --help documents every option (help
text, PDSERVE_* variable, default), `pdserve --help` answers fast and without torch, every setting of every
command is taken from its flag, its PDSERVE_* variable and the --config file (flag > environment > file),
secrets come only from the environment or files, and bad values end in one line naming them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import click
import pytest
from pdserve.cli.main import command as pdserve_command
from pdserve.cli.main import pdserve
from pdserve.kvctl.cli import kvctl
from pdserve.shared.cli.settings import (
    Settings,
    SettingsError,
    env_name,
    flag_name,
    given_flags,
    load_settings,
    read_secret,
)

PDSERVE_COMMANDS = ("generate", "up", "router", "prefill", "decode", "single", "bench", "plan")
COMMANDS: list[tuple[click.Group, str]] = [
    *((pdserve, name) for name in PDSERVE_COMMANDS),
    *((kvctl, name) for name in ("nodes", "blocks", "where", "stats", "drain", "undrain", "evict")),
]
SPECIAL = {"block_size": 32, "device": "cuda:1"}


def settings_class(group: click.Group, name: str) -> type[Settings]:
    """The settings model whose fields a command's options are (read back from its click callback)."""
    from pdserve.cli.up_options import UpOptions
    from pdserve.kvctl import actions as kvctl_cli
    from pdserve.node.node_cli import DecodeOptions, PrefillOptions
    from pdserve.router.__main__ import RouterOptions

    if group is pdserve:
        from pdserve.cli.bench_options import BenchOptions
        from pdserve.cli.plan_options import PlanOptions
        from pdserve.shared.cli.engine_args import GenerateOptions

        commands: dict[str, type[Settings]] = {"generate": GenerateOptions, "up": UpOptions,
            "router": RouterOptions, "prefill": PrefillOptions, "bench": BenchOptions,
            "plan": PlanOptions}  # fmt: skip
        return commands.get(name, DecodeOptions)
    classes: dict[str, type[Settings]] = {"blocks": kvctl_cli.Blocks, "where": kvctl_cli.PromptOptions,
        "evict": kvctl_cli.Evict, "drain": kvctl_cli.Drain, "undrain": kvctl_cli.NodeAction}  # fmt: skip
    return classes.get(name, kvctl_cli.Common)


def get_command(group: click.Group, name: str) -> click.Command:
    found = pdserve_command(name) if group is pdserve else group.get_command(click.Context(group), name)
    assert found is not None, name
    return found


def sample(name: str, annotation: Any, default: Any) -> Any:
    """A valid value of a field other than its default."""
    if name in SPECIAL:
        return SPECIAL[name]
    if typing.get_origin(annotation) is tuple:
        return ("a", "b")
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return sample(name, args[0], default)
    if typing.get_origin(annotation) is typing.Literal:
        return next(a for a in reversed(args) if a != default)
    return {bool: not default, int: 7, float: 0.5, str: "x"}[annotation]


def as_flag(value: Any) -> list[str]:
    return [",".join(value)] if isinstance(value, tuple) else [str(value)]


def as_env(value: Any) -> str:
    return (
        ",".join(value)
        if isinstance(value, tuple)
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


def as_toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(value) if isinstance(value, str) else str(value)


@pytest.mark.parametrize(("group", "name"), COMMANDS, ids=[f"{g.name}-{n}" for g, n in COMMANDS])
def test_help_documents_every_option(group: click.Group, name: str) -> None:
    command = get_command(group, name)
    ctx = click.Context(command, info_name=name)
    text = command.get_help(ctx)
    records = {}
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is not None:
            records[param.name] = " ".join(record[1].split())
    cls = settings_class(group, name)
    for field_name, field in cls.model_fields.items():
        flag = flag_name(field_name, cls)
        assert flag in text, f"{name}: {flag} missing from --help"
        help_text = records[field_name]
        assert field.description and help_text.startswith(field.description.split()[0]), f"{name}: {flag}"
        assert f"[env: {env_name(field_name)}]" in help_text, f"{name}: {flag} does not name its variable"
        if field.is_required():
            assert "[default: (required)]" in help_text, flag
        elif field.default is True:
            assert f"[default: {flag[2:]}]" in help_text, (flag, help_text)
        elif field.default not in (None, "", (), False):
            assert f"[default: ({field.default})]" in help_text, (flag, help_text)
    assert "--config" in text


def test_pdserve_help_is_fast_and_imports_no_torch() -> None:
    code = "import sys; from pdserve.cli.main import main; main(['--help']); main(['--version']); "
    code += "print('PYDANTIC', 'pydantic' in sys.modules); main(['router', '--help']); "
    code += "print('TORCH', 'torch' in sys.modules)"
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    assert "TORCH False" in done.stdout
    assert "PYDANTIC False" in done.stdout, "the group's --help and --version build no command"
    t0 = time.perf_counter()
    fast = subprocess.run([sys.executable, "-m", "pdserve.cli", "--help"], capture_output=True, timeout=60)
    assert fast.returncode == 0
    assert time.perf_counter() - t0 < 3.0 and seconds < 6.0  # about 0.25 s each on the 2-core CI VM


def test_version() -> None:
    for main in ("pdserve.cli", "pdserve.kvctl.cli"):
        done = subprocess.run(
            [sys.executable, "-m", main, "--version"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and "version" in done.stdout


@pytest.mark.parametrize(("group", "name"), COMMANDS, ids=[f"{g.name}-{n}" for g, n in COMMANDS])
def test_every_setting_from_flag_env_and_file(
    group: click.Group, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = settings_class(group, name)
    command = get_command(group, name)
    for key in list(os.environ):
        if key.startswith("PDSERVE_"):
            monkeypatch.delenv(key)
    required = {n: 9 if n == "port" else "r" for n, f in cls.model_fields.items() if f.is_required()}
    argv = [
        *(a for n, v in required.items() for a in (flag_name(n, cls), str(v))),
        *(["n0"] if "drain" in name else []),
    ]
    for field_name, field in cls.model_fields.items():
        value = sample(field_name, field.annotation, field.default)
        flag = flag_name(field_name, cls)
        # flag
        args = [flag] if isinstance(value, bool) else [flag, *as_flag(value)]
        if isinstance(value, bool) and not value:
            args = [f"--no-{flag[2:]}"]
        ctx = command.make_context(name, [*argv, *args])
        got = load_settings(cls, given_flags(ctx, cls, ctx.params), None)
        assert getattr(got, field_name) == value, (name, "flag", field_name)
        # file, then the environment over it, then a flag over both
        path = tmp_path / "settings.toml"
        lines = [f"{n} = {as_toml(v)}" for n, v in required.items() if n != field_name]
        path.write_text("\n".join([*lines, f"{field_name} = {as_toml(value)}"]) + "\n")
        assert getattr(load_settings(cls, {}, str(path)), field_name) == value, (name, "file", field_name)
        path.write_text("\n".join([*lines, f"{field_name} = {as_toml(field.default)}"]) + "\n")
        if field.default is not None and not field.is_required():
            monkeypatch.setenv(env_name(field_name), as_env(value))
            assert getattr(load_settings(cls, {}, str(path)), field_name) == value, (name, "env", field_name)
            flagged = load_settings(cls, {field_name: field.default}, str(path))
            assert getattr(flagged, field_name) == field.default, (name, "flag over env", field_name)
            monkeypatch.delenv(env_name(field_name))


def test_bad_values_name_their_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.router.__main__ import RouterOptions

    monkeypatch.setenv("PDSERVE_MAX_N", "many")
    with pytest.raises(SettingsError, match=r"^PDSERVE_MAX_N='many': Input should be a valid integer"):
        load_settings(RouterOptions, {"model": "m", "redis": "r"}, None)
    (tmp_path / "c.toml").write_text('modle = "m"\n')
    with pytest.raises(SettingsError, match=r"c.toml: unknown setting 'modle'"):
        load_settings(RouterOptions, {}, str(tmp_path / "c.toml"))
    monkeypatch.delenv("PDSERVE_MAX_N")
    with pytest.raises(
        SettingsError, match=r"^--redis is required \(or set PDSERVE_REDIS, or `redis` in --config\)"
    ):
        load_settings(RouterOptions, {"model": "m"}, None)


def test_secrets_from_environment_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    with pytest.raises(SettingsError, match=r"^the KV-transfer token is missing: set PDSERVE_AUTH_TOKEN "):
        read_secret("auth_token", "the KV-transfer token", None, required=True)
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "from-env")
    assert read_secret("auth_token", "the token", None, required=True) == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    assert read_secret("auth_token", "the token", str(tmp_path / "token"), required=True) == "from-file"
    with pytest.raises(SettingsError, match=r"^PDSERVE_AUTH_TOKEN_FILE=.*missing: cannot read the token"):
        read_secret("auth_token", "the token", str(tmp_path / "missing"), required=True)
    for group, name in COMMANDS:
        flags = {o for p in get_command(group, name).params for o in p.opts}
        assert not flags & {"--auth-token", "--api-key", "--api-keys", "--redis-password"}, name


def _one_error_line(*args: str, env: dict[str, str] | None = None) -> str:
    """Runs `pdserve ARGS`, asserts a non-zero exit and exactly one line on stderr; returns it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | (env or {})
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=60, env=environ
    )
    assert done.returncode != 0 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), done.stderr
    return lines[0]


def test_start_up_failures_are_one_line(tmp_path: Path) -> None:
    line = _one_error_line("generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--prompt", "hi")
    assert "Hugging Face hub id, download it first" in line and "HuggingFaceTB/SmolLM2-135M-Instruct" in line
    line = _one_error_line("router", "--model", "Qwen/Qwen2.5-0.5B", "--redis", "redis://127.0.0.1:1")
    assert "download it first" in line
    line = _one_error_line("prefill", "--connector", "infiniband")
    assert "'infiniband' is not one of 'tcp', 'ucx', 'nccl', 'cuda_ipc'" in line
    line = _one_error_line("decode", "--model", str(tmp_path), "--node-id", "d0", "--port", "1")
    assert "PDSERVE_AUTH_TOKEN" in line
    if importlib.util.find_spec("ucxx") is None:  # a CPU install without the [ucx] extra
        args = ("--model", str(tmp_path), "--node-id", "d0", "--port", "1", "--connector", "ucx")
        line = _one_error_line("decode", *args, env={"PDSERVE_AUTH_TOKEN": "t" * 16})
        assert "--connector ucx needs ucxx: install the [ucx] extra" in line
    line = _one_error_line("up", "--prefill-args", "--connector carrier-pigeon")
    assert line.startswith("pdserve: error: --prefill-args: ") and "carrier-pigeon" in line
    line = _one_error_line("up", "--decode-ports", "1,2", "--decode", "1")
    assert "--decode-ports '1,2': give exactly 1 ports" in line


def test_connector_choices_match_the_registry() -> None:
    from pdserve.node.node_cli import Connector

    # a fresh interpreter: test modules register stand-in connectors in this one (test_kvtransfer_pair_group)
    code = "from pdserve.kvtransfer.connector import connector_kinds; print(','.join(connector_kinds()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert sorted(typing.get_args(Connector)) == done.stdout.strip().split(",")


def test_every_process_that_reaches_redis_takes_its_password_file_and_ca_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis access (password's file, CA bundle of a rediss:// server) is declared once and taken by every
    command with --redis; the router's and a node's index clients get both."""
    from pdserve.node.node_cli import DecodeOptions, node_configs
    from pdserve.router.__main__ import RouterOptions, router_config

    for group, name in COMMANDS:
        fields = settings_class(group, name).model_fields
        if "redis" in fields:
            assert {"redis_password_file", "tls_ca_file"} <= set(fields), name
    for key in list(os.environ):
        if key.startswith("PDSERVE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "token")
    (tmp_path / "password").write_text("s3cret\n")
    ca = str(tmp_path / "ca.pem")
    access = {
        "redis": "rediss://h:6380",
        "redis_password_file": str(tmp_path / "password"),
        "tls_ca_file": ca,
    }
    router = router_config(load_settings(RouterOptions, {"model": str(tmp_path), **access}, None))
    node_opts = {"model": "dummy:tiny", "node_id": "d0", "port": 9, **access}
    node = node_configs(load_settings(DecodeOptions, node_opts, None), "decode")
    assert node.node.redis is not None
    for redis in (router.redis, node.node.redis):
        assert (redis.password, redis.tls_ca_file) == ("s3cret", ca)
