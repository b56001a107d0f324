"""The settings of `pdserve up` and the UpConfig built from them.

Node and router flags pass through per role (`--node-args`, `--prefill-args`, `--decode-args`,
`--router-args`, each one shell-quoted string) and are checked here, in the parent, against the child's own
settings model, so a bad flag fails in a second, not after the first node loaded its model. Ports can be
pinned per role; unpinned ones are free ports.
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from pdserve.shared.cli.settings import Settings, SettingsError, flag_name, load_settings
from pydantic import Field

if TYPE_CHECKING:
    from pdserve.cli.up import UpConfig

_SET_BY_UP = ("node_id", "port", "redis", "model", "config_file")


class UpOptions(Settings):
    model: str = Field("", description="model of every node and the router (default: the SmolLM2 file)")
    served_model_name: str | None = Field(
        None, description="model id(s) of the API, comma-separated (default: the model's file name)"
    )
    port: int = Field(8000, ge=1, le=65535, description="port of the router's OpenAI API")
    prefill: int = Field(1, ge=0, description="prefill nodes (0: single nodes instead of P/D)")
    decode: int = Field(1, ge=1, description="decode nodes (or single nodes with --prefill 0)")
    threads: int = Field(max(1, (os.cpu_count() or 2) // 2), ge=1, description="torch threads per node")
    node_args: str = Field("", description='flags for every node, e.g. "--device cuda --connector nccl"')
    prefill_args: str = Field("", description="flags for the prefill nodes (after --node-args)")
    decode_args: str = Field("", description="flags for the decode or single nodes (after --node-args)")
    router_args: str = Field("", description='flags for the router, e.g. "--max-n 4"')
    prefill_ports: str = Field(
        "", description="comma-separated HTTP ports of the prefill nodes (default: free)"
    )
    decode_ports: str = Field(
        "", description="comma-separated HTTP ports of the decode/single nodes (default: free)"
    )
    demo: bool = Field(False, description="send one chat request and print the answer")
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or a file holding one, for the router and every node"
    )
    redis_aof: bool = Field(
        False, description="Redis keeps an append-only file in the work directory: a restart keeps the index"
    )
    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="the cluster file's name, which `kvctl --cluster NAME` picks while several clusters run",
    )


def _ports(text: str, count: int, option: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        ports = tuple(int(p) for p in text.split(","))
    except ValueError as exc:
        raise SettingsError(f"{option} {text!r}: give comma-separated port numbers") from exc
    if len(ports) != count or not all(0 < p < 65536 for p in ports):
        raise SettingsError(f"{option} {text!r}: give exactly {count} ports in 1..65535")
    return ports


def _checked_args(command: str, text: str, option: str, fixed: dict[str, object]) -> tuple[str, ...]:
    """`text` split like a shell would, after checking it against `pdserve <command>`'s own settings."""
    from pdserve.cli.main import command as pdserve_command
    from pdserve.shared.cli.settings import given_flags

    try:
        args = shlex.split(text)
    except ValueError as exc:
        raise SettingsError(f"{option} {text!r}: {exc}") from exc
    import click

    try:
        ctx = pdserve_command(command).make_context(command, list(args))
    except click.ClickException as exc:
        raise SettingsError(f"{option}: {exc.format_message()}") from exc
    given = given_flags(ctx, _settings_class(command), ctx.params)
    for name in _SET_BY_UP:
        if name in given:
            raise SettingsError(f"{option}: {flag_name(name)} is set by `pdserve up` (see --prefill-ports)")
    try:
        load_settings(_settings_class(command), {**fixed, **given}, ctx.params.get("config_file"))
    except SettingsError as exc:
        raise SettingsError(f"{option}: {exc}") from exc
    return tuple(args)


def _settings_class(command: str) -> type[Settings]:
    from pdserve.node.node_cli import DecodeOptions, PrefillOptions
    from pdserve.router.__main__ import RouterOptions

    classes: dict[str, type[Settings]] = {"router": RouterOptions, "prefill": PrefillOptions}
    return classes.get(command, DecodeOptions)


def up_config(opts: UpOptions, model: str) -> UpConfig:
    """The UpConfig of validated options, every passed-through flag checked."""
    from pdserve.cli.up import UpConfig

    node = {"node_id": "check", "port": 1, "model": model}
    d_role = "decode" if opts.prefill else "single"
    node_args = _checked_args("decode", opts.node_args, "--node-args", node)
    prefill_args = _checked_args("prefill", opts.prefill_args, "--prefill-args", node)
    decode_args = _checked_args(d_role, opts.decode_args, "--decode-args", node)
    router_args = _checked_args("router", opts.router_args, "--router-args", {"model": model, "redis": "x"})
    if opts.chat_template:
        from pdserve.shared.cli.settings import chat_template_text

        chat_template_text(opts.chat_template)  # checked here, once, before anything starts
        template = os.path.abspath(opts.chat_template) if os.path.isfile(opts.chat_template) else None
        flag = ("--chat-template", template or opts.chat_template)
        router_args, node_args = (*flag, *router_args), (*flag, *node_args)
    if opts.served_model_name:
        router_args = ("--served-model-name", opts.served_model_name, *router_args)
        node_args = ("--served-model-name", opts.served_model_name.split(",")[0], *node_args)
    return UpConfig(
        model=model,
        port=opts.port,
        prefill=opts.prefill,
        decode=opts.decode,
        threads_per_node=opts.threads,
        extra_node_args=node_args,
        demo=opts.demo,
        role_node_args=(("prefill", prefill_args), (d_role, decode_args)),
        role_ports=(
            ("prefill", _ports(opts.prefill_ports, opts.prefill, "--prefill-ports")),
            (d_role, _ports(opts.decode_ports, opts.decode, "--decode-ports")),
        ),
        router_args=router_args,
        redis_aof=opts.redis_aof,
        name=opts.name,
    )
