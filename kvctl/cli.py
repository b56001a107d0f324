"""`kvctl`: where the KV cache lives (nodes, blocks, where, stats, diff) and actions on it (drain, undrain,
evict, diff --repair).

Invariants: every command takes `--redis URL`, `--cluster NAME` and `--json` (machine output on stdout,
every command), each also from PDSERVE_* variables or `--config FILE` like every pdserve process; the
Redis password only from PDSERVE_REDIS_PASSWORD or the file PDSERVE_REDIS_PASSWORD_FILE names. People get
tables (rich). Exit codes: 0 done; 1 Redis or a node unreachable or refused the action (one line on
stderr); 2 bad arguments. A reader of stdout that goes away (`kvctl blocks --json | head -1`) ends it
quietly with 1: click catches the broken pipe and silences the final flush.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
from pdserve.kvctl import commands
from pdserve.kvctl.render import render
from pdserve.shared.cli.settings import (
    SecretFiles,
    SettingsError,
    click_options,
    read_secret,
    settings_from_click,
)
from pydantic import Field

_CONTEXT = {"help_option_names": ["-h", "--help"]}


class Common(SecretFiles):
    redis: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL of the index")
    auth_token_file: str | None = Field(
        None,
        description="file holding the cluster's credential, the nodes' KV-transfer token (else "
        "PDSERVE_AUTH_TOKEN is read): it verifies the nodes' records and signs calls to nodes",
    )
    cluster: str = Field("default", description="cluster name (key prefix) in Redis")
    tls_ca_file: str | None = Field(None, description="CA bundle to verify a rediss:// server")
    json_output: bool = Field(
        False, description="print JSON instead of a table", json_schema_extra={"flag": "--json"}
    )
    timeout: float = Field(5.0, gt=0, description="seconds per Redis or node call")


class Blocks(Common):
    node: str | None = Field(None, description="list this node's block hashes")
    limit: int = Field(20, ge=0, description="hashes to list per node")


class PromptOptions(Common):
    model: str | None = Field(
        None, description="model whose tokenizer/chat template to use (default SmolLM2)"
    )
    cache_salt: str | None = Field(
        None, description="the tenant's cache salt (as in the request's cache_salt)"
    )
    prompt: str | None = Field(None, description="prompt text (encoded as a completion prompt)")
    messages: str | None = Field(None, description="chat messages as JSON (chat template applied)")


class Evict(PromptOptions):
    node: str = Field(description="node id")
    all: bool = Field(False, description="every cached-free block of the node (instead of a prompt's)")
    index_only: bool = Field(False, description="drop the index records only (repair)")


class NodeAction(Common):
    url: str | None = Field(None, description="the node's HTTP URL (default: from its registration)")


class Diff(Common):
    node: str | None = Field(None, description="compare this node only (default: every live node)")
    repair: bool = Field(False, description="let each node fix the records that disagree with its blocks")


def _token(opts: Common) -> str:
    token = read_secret("auth_token", "the cluster's KV-transfer token", opts.auth_token_file, required=True)
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

    password = read_secret("redis_password", "the Redis password", opts.redis_password_file, required=False)
    try:
        config = RedisConfig(
            url=opts.redis, password=password, cluster=opts.cluster, tls_ca_file=opts.tls_ca_file,
            socket_timeout_s=opts.timeout,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    async with BlockIndex(config, ClusterKeys(_token(opts))) as index:
        await index.ping()
        result: dict[str, Any] = await action(index)
        return result


def _command(group: click.Group, name: str, cls: type[Common], doc: str, node_arg: bool = False) -> Callable:
    def register(make: Callable[[Any, Any], Any]) -> None:
        @group.command(name, help=doc, context_settings=_CONTEXT)
        @click_options(cls)
        @click.pass_context
        def command(ctx: click.Context, node_id: str | None = None, **values: Any) -> None:
            opts = settings_from_click(cls, ctx, values)
            action = make(opts, node_id)
            result = asyncio.run(_run(opts, action))
            click.echo(json.dumps(result, indent=2) if opts.json_output else render(name, result))

        if node_arg:
            click.argument("node_id")(command)

    return register


@click.group(context_settings=_CONTEXT, help=__doc__.split("\n\n")[0])
@click.version_option(None, "-V", "--version", package_name="pdserve", prog_name="kvctl")
def kvctl() -> None:
    pass


_command(kvctl, "nodes", Common, "Live nodes: role, epoch, load, KV use, blocks, heartbeat.")(
    lambda opts, _: commands.nodes
)
_command(kvctl, "blocks", Blocks, "Block records per node (hashes with --node).")(
    lambda opts, _: lambda index: commands.blocks(index, opts.node, opts.limit)
)
_command(kvctl, "stats", Common, "Prefix hits local/transferred/miss in tokens, per node and overall.")(
    lambda opts, _: commands.stats
)


def _drain(opts: NodeAction, node: str) -> Callable[[Any], Any]:
    token = _token(opts)
    return lambda index: commands.drain(index, node, opts.timeout, token, opts.url)


def _undrain(opts: NodeAction, node: str) -> Callable[[Any], Any]:
    token = _token(opts)
    return lambda index: commands.undrain(index, node, opts.timeout, token, opts.url)


_command(kvctl, "drain", NodeAction, "Stop new work on a node; it finishes, then leaves.", node_arg=True)(
    _drain
)
_command(kvctl, "undrain", NodeAction, "Give a drained node new work again.", node_arg=True)(_undrain)


def _diff(opts: Diff, _: None) -> Callable[[Any], Any]:
    token = _token(opts)
    return lambda index: commands.diff(index, opts.node, opts.repair, opts.timeout, token)


_command(kvctl, "diff", Diff, "Index records against the blocks each node holds (--repair fixes them).")(
    _diff
)


def _where(opts: PromptOptions, _: None) -> Callable[[Any], Any]:
    prompt, messages = _prompt(opts)
    tokens = commands.tokenize(opts.model, prompt, messages)
    return lambda index: commands.where(index, tokens, opts.cache_salt)


def _evict(opts: Evict, _: None) -> Callable[[Any], Any]:
    prompt, messages = _prompt(opts, allow_all=True)
    tokens = None if opts.all else commands.tokenize(opts.model, prompt, messages)
    token = None if opts.index_only else _token(opts)
    return lambda index: commands.evict(
        index, opts.node, tokens, opts.cache_salt, opts.index_only, opts.timeout, token
    )


_command(kvctl, "where", PromptOptions, "Which nodes hold a prompt's prefix blocks.")(_where)
_command(kvctl, "evict", Evict, "Evict a prompt's cached blocks (or all) from a node.")(_evict)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; usage errors exit 2 (SystemExit), failures return 1 with one line on stderr."""
    from pdserve.shared.index.block_index_types import BlockIndexError

    args = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in args if not a.startswith("-")), "kvctl")
    try:
        kvctl.main(args, prog_name="kvctl", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except (click.UsageError, SettingsError) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        print(f"kvctl {name}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except (BlockIndexError, commands.KvctlError) as exc:
        print(f"kvctl {name}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
