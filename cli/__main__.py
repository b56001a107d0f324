"""`python -m pdserve.cli`: the `pdserve` command."""

import sys

from pdserve.cli.main import main

sys.exit(main())
