"""kvctl's commands as click commands built from their settings models (kvctl/cli.py builds one only when it
runs or shows its help, so `kvctl --help` imports click alone): each command's options, how it finds the
cluster (--redis, else the running `pdserve up`'s cluster file) and the credential, and which function of
commands.py it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import click
from pdserve.shared.cli import cluster_file
from pdserve.shared.cli.settings import (
    RedisAccess,
    SettingsError,
    chat_template_text,
    click_options,
    read_secret,
    settings_from_click,
)
from pdserve.shared.types import ROLES, Role
from pydantic import Field

_CONTEXT = {"help_option_names": ["-h", "--help"]}


class Common(RedisAccess):
    redis: str | None = Field(
        None,
        description="redis://, rediss:// or redis+sentinel://host:port[,host:port]/service URL of the index "
        "(default: the running `pdserve up`'s)",
    )
    cluster: str | None = Field(
        None,
        description="the `pdserve up` cluster to use (by its --name) or, with --redis, the cluster name (key "
        "prefix) in Redis (default: the only running `pdserve up`; with --redis, 'default')",
    )
    auth_token_file: str | None = Field(
        None,
        description="file holding the cluster's credential, the nodes' KV-transfer token (else "
        "PDSERVE_AUTH_TOKEN is read, else the file the `pdserve up` cluster file names): it verifies the "
        "nodes' records and signs calls to nodes",
    )
    json_output: bool = Field(
        False, description="print JSON instead of a table", json_schema_extra={"flag": "--json"}
    )
    timeout: float = Field(5.0, gt=0, description="seconds per Redis or node call")


class Blocks(Common):
    node: str | None = Field(None, description="only this node (default: every live node)")
    limit: int = Field(20, ge=0, description="hashes to list per node (0: counts only)")


class PromptOptions(Common):
    model: str | None = Field(
        None, description="model whose tokenizer/chat template to use (default SmolLM2)"
    )
    cache_salt: str | None = Field(
        None, description="the tenant's cache salt (as in the request's cache_salt)"
    )
    prompt: str | None = Field(None, description="prompt text (encoded as a completion prompt)")
    messages: str | None = Field(None, description="chat messages as JSON (chat template applied)")
    chat_template: str | None = Field(
        None, description="the cluster's --chat-template (a Jinja template or a file), if it set one"
    )


class Evict(PromptOptions):
    node: str = Field(description="node id")
    all: bool = Field(False, description="every cached-free block of the node (instead of a prompt's)")
    index_only: bool = Field(False, description="drop the index records only (repair)")


class NodeAction(Common):
    url: str | None = Field(None, description="the node's HTTP URL (default: from its registration)")


class Drain(NodeAction):
    move_prefixes: bool = Field(
        False,
        description="first move the node's hottest cached prefixes (by hits, then recency) to the nodes the "
        "router would send them to next, so they stay cached; a plain drain when none can take them",
    )
    budget_bytes: int = Field(
        1 << 30, ge=0, description="with --move-prefixes: at most this many bytes of KV blocks move"
    )
    move_timeout: float = Field(
        60.0, gt=0, description="with --move-prefixes: seconds for moving every prefix, all together"
    )
    migrate: bool = Field(
        False,
        description="end the node's running requests so that the router continues them on other nodes, "
        "which fetch their KV (prompt and generated tokens) from this node instead of prefilling it",
    )


class RoleChange(NodeAction):
    role: Role = Field(description="the node's new role (the ROLE argument)")
    force: bool = Field(
        False, description="change it even if that leaves no prefill- or no decode-capable node"
    )
    migrate: bool = Field(
        False,
        description="end the node's running decodes so the router continues them on other nodes (default: "
        "they run to the end on it first)",
    )
    wait: float = Field(600.0, gt=0, description="seconds to wait for the node to register in its new role")


class Diff(Common):
    node: str | None = Field(None, description="compare this node only (default: every live node)")
    repair: bool = Field(False, description="let each node fix the records that disagree with its blocks")


def _commands() -> ModuleType:
    """kvctl/commands.py, imported when a command runs (Redis, httpx2 and the cost model: not for --help)."""
    from pdserve.kvctl import commands

    return commands


def _up_cluster(opts: Common) -> cluster_file.ClusterFile | None:
    """The running `pdserve up` cluster's file when no --redis is given; SettingsError when none runs."""
    if opts.redis is not None:
        return None
    directory = cluster_file.cluster_dir(os.environ)
    found = cluster_file.find(directory, opts.cluster)
    if found is None:
        raise SettingsError(
            f"no running `pdserve up` cluster (no cluster file in {directory}): give --redis URL "
            "(or PDSERVE_REDIS)"
        )
    return found


def _token(opts: Common) -> str:
    """The credential: --auth-token-file or PDSERVE_AUTH_TOKEN, else the file the cluster file names."""
    what = "the cluster's KV-transfer token"
    token = read_secret("auth_token", what, opts.auth_token_file, required=False)
    if token is None:
        up = _up_cluster(opts)
        token = read_secret("auth_token", what, None if up is None else up.auth_token_file, required=True)
    assert token is not None
    return token


def _messages(text: str | None) -> list[dict[str, Any]] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--messages is not JSON ({exc}): {text[:60]!r}") from exc
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise click.UsageError(
            f'--messages must be a JSON list of {{"role", "content"}} objects: {text[:60]!r}'
        )
    return value


def _prompt(opts: PromptOptions, allow_all: bool = False) -> tuple[str | None, list[dict[str, Any]] | None]:
    given = [n for n in ("prompt", "messages") if getattr(opts, n) is not None]
    if allow_all and getattr(opts, "all", False):
        given.append("all")
    if len(given) != 1:
        names = "--prompt, --messages" + (", --all" if allow_all else "")
        raise click.UsageError(f"give exactly one of {names}")
    return opts.prompt, _messages(opts.messages)


async def _run(opts: Common, action: Callable[[Any], Any]) -> dict[str, Any]:
    from pdserve.shared.index.block_index import BlockIndex
    from pdserve.shared.index.block_index_types import RedisConfig
    from pdserve.shared.node.node_sign import ClusterKeys

    up = _up_cluster(opts)
    password = opts.redis_password()
    url, cluster = opts.redis, opts.cluster or "default"
    if up is not None:
        url, cluster, password = up.redis_url, up.index_cluster, password or up.redis_password or None
    assert url is not None
    try:
        config = RedisConfig(
            url=url, password=password, cluster=cluster, tls_ca_file=opts.tls_ca_file,
            socket_timeout_s=opts.timeout,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    async with BlockIndex(config, ClusterKeys(_token(opts))) as index:
        await index.ping()
        result: dict[str, Any] = await action(index)
        return result


def _drain(opts: Drain, node: str) -> Callable[[Any], Any]:
    token = _token(opts)
    budget = opts.budget_bytes if opts.move_prefixes else None
    return lambda index: _commands().drain(
        index, node, opts.timeout, token, opts.url, budget, opts.move_timeout, opts.migrate
    )


def _undrain(opts: NodeAction, node: str) -> Callable[[Any], Any]:
    token = _token(opts)
    up = _up_cluster(opts)
    known = None if up is None else up.nodes.get(node)
    return lambda index: _commands().undrain(index, node, opts.timeout, token, opts.url, known)


def _role(opts: RoleChange, node: str) -> Callable[[Any], Any]:
    token = _token(opts)
    return lambda index: _commands().role(
        index, node, opts.role, token, force=opts.force, migrate=opts.migrate, timeout_s=opts.timeout,
        wait_s=opts.wait, url=opts.url,
    )  # fmt: skip


def _diff(opts: Diff, _: None) -> Callable[[Any], Any]:
    token = _token(opts)
    return lambda index: _commands().diff(index, opts.node, opts.repair, opts.timeout, token)


def _where(opts: PromptOptions, _: None) -> Callable[[Any], Any]:
    prompt, messages = _prompt(opts)
    tokens = _commands().tokenize(opts.model, prompt, messages, chat_template_text(opts.chat_template))
    return lambda index: _commands().where(index, tokens, opts.cache_salt)


def _evict(opts: Evict, _: None) -> Callable[[Any], Any]:
    prompt, messages = _prompt(opts, allow_all=True)
    tokens = (
        None
        if opts.all
        else _commands().tokenize(opts.model, prompt, messages, chat_template_text(opts.chat_template))
    )
    token = None if opts.index_only else _token(opts)
    return lambda index: _commands().evict(
        index, opts.node, tokens, opts.cache_salt, opts.index_only, opts.timeout, token
    )


COMMANDS: dict[str, tuple[type[Common], Callable[[Any, Any], Callable[[Any], Any]], bool]] = {
    "nodes": (Common, lambda opts, _: _commands().nodes, False),
    "blocks": (Blocks, lambda opts, _: lambda index: _commands().blocks(index, opts.node, opts.limit), False),
    "stats": (Common, lambda opts, _: _commands().stats, False),
    "drain": (Drain, _drain, True),
    "undrain": (NodeAction, _undrain, True),
    "role": (RoleChange, _role, True),
    "diff": (Diff, _diff, False),
    "where": (PromptOptions, _where, False),
    "evict": (Evict, _evict, False),
}
"""name -> (settings model, the action it runs given the settings and the NODE argument, takes NODE)."""
ARGUMENTS: dict[str, tuple[tuple[str, click.ParamType], ...]] = {"role": (("role", click.Choice(ROLES)),)}
"""Fields of a command's settings given as positional arguments after NODE (name, type), not as options."""


def build(name: str, doc: str) -> click.Command:
    """The click command `kvctl <name>`."""
    cls, make, node_arg = COMMANDS[name]
    arguments = ARGUMENTS.get(name, ())

    @click.command(name, help=doc, context_settings=_CONTEXT)
    @click_options(cls, hidden=frozenset(a for a, _ in arguments))
    @click.pass_context
    def command(ctx: click.Context, node_id: str | None = None, **values: Any) -> None:
        opts = settings_from_click(cls, ctx, values)
        action = make(opts, node_id)
        result = asyncio.run(_run(opts, action))
        if opts.json_output:
            click.echo(json.dumps(result, indent=2))
        else:
            from pdserve.kvctl.render import render

            click.echo(render(name, result))

    if node_arg:
        click.argument("node_id")(command)
    for argument, kind in arguments:  # appended to the built command's parameters, in order
        click.argument(argument, type=kind, metavar=argument.upper())(command)
    return command
