"""`python tools/plan_layout.py`: megatron_hetero/cli/plan.py (its docstring gives the usage)."""

import sys

from megatron_hetero.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
