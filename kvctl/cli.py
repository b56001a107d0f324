"""`kvctl`: where the KV cache lives (nodes, blocks, where, stats, diff) and actions on it (drain, undrain,
role, evict, diff --repair).

Invariants: every command takes `--redis URL`, `--cluster NAME` and `--json` (machine output on stdout,
every command), each also from PDSERVE_* variables or `--config FILE` like every pdserve process. Without
`--redis` it uses the running `pdserve up` cluster's file (shared/cli/cluster_file.py: its Redis URL and
password, its credential's file, its nodes' URLs; `--cluster NAME` picks one while several run). The Redis
password otherwise comes only from PDSERVE_REDIS_PASSWORD or the file PDSERVE_REDIS_PASSWORD_FILE names.
People get tables (rich). Exit codes: 0 done; 1 Redis or a node unreachable or refused the action (one line
on stderr); 2 bad arguments. A reader of stdout that goes away (`kvctl blocks --json | head -1`) ends it
quietly with 1: click catches the broken pipe and silences the final flush. `--help` imports click and
pydantic only: the commands, Redis and the tokenizer are imported when a command runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

_CONTEXT = {"help_option_names": ["-h", "--help"]}
_COMMANDS = {
    "nodes": "Live nodes: role, epoch, load, KV use, blocks, heartbeat.",
    "blocks": "Block records per node: counts on device and host, and up to --limit hashes.",
    "stats": "Prefix hits local/remote/miss in tokens, per node and overall.",
    "drain": "Stop new work on a node; it finishes, then leaves (--move-prefixes: its hot prefixes first "
    "move to the nodes that take them next; --migrate: its running requests move with their KV).",
    "undrain": "Give a drained node new work again.",
    "role": "Change a node's role (prefill, decode, single) at run time, keeping its prefix cache.",
    "diff": "Index records against the blocks each node holds (--repair fixes them).",
    "where": "Which nodes hold a prompt's prefix blocks.",
    "evict": "Evict a prompt's cached blocks (or all) from a node.",
}
"""The commands (built on demand by kvctl/actions.py), with the help `kvctl --help` lists for them."""


class _LazyGroup(click.Group):
    """Builds a command (importing pydantic and its settings model) only when it runs or shows its help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            from pdserve.kvctl.actions import build

            self.add_command(build(cmd_name, _COMMANDS[cmd_name]))
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl(list(_COMMANDS.items()))


@click.group(cls=_LazyGroup, context_settings=_CONTEXT, help=__doc__.split("\n\n")[0])
@click.version_option(None, "-V", "--version", package_name="pdserve", prog_name="kvctl")
def kvctl() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; usage errors exit 2 (SystemExit), failures return 1 with one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in args if not a.startswith("-")), "kvctl")
    try:
        kvctl.main(args, prog_name="kvctl", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.UsageError as exc:
        message = " ".join(exc.format_message().split())  # one line (click lists choices on several)
        print(f"kvctl {name}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as exc:  # the settings', the index's and the commands' errors, imported once raised
        from pdserve.kvctl.commands import KvctlError
        from pdserve.shared.cli.settings import SettingsError
        from pdserve.shared.index.block_index_types import BlockIndexError

        if isinstance(exc, SettingsError):
            print(f"kvctl {name}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if not isinstance(exc, BlockIndexError | KvctlError):
            raise
        print(f"kvctl {name}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
