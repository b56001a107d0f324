"""`python -m pdserve.decode_node` (= `pdserve decode`; with --role single, `pdserve single`): a decode node
or a plain non-disaggregated node (cli/node_roles.py adds its parts, and the other roles', so it can change
role at run time)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """`--role single` (what `pdserve up` passes to single nodes) picks the `single` command."""
    from pdserve.cli.main import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    command = "decode"
    if "--role" in args:
        i = args.index("--role")
        command = args[i + 1] if i + 1 < len(args) else "decode"
        del args[i : i + 2]
    if command not in ("decode", "single"):
        print(f"pdserve decode: error: --role {command!r}: accepted decode, single", file=sys.stderr)
        return 2
    return cli_main([command, *args])


if __name__ == "__main__":
    sys.exit(main())
