"""`python tools/verify_layout.py`: megatron_hetero/cli/verify.py (its docstring gives the usage)."""

import sys

from megatron_hetero.cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
