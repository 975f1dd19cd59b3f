"""`python -m megatron_hetero.cli`: the `megatron-hetero` command (cli/main.py)."""

import sys

from megatron_hetero.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
