"""`python -m pdserve.prefill_node` (= `pdserve prefill`): a prefill node (cli/node_roles.py adds its parts,
and the other roles', so it can change role at run time)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pdserve.cli.main import main as cli_main

    return cli_main(["prefill", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
