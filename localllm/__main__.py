"""`python -m localllm ARGS`: the CLI (what torch's launcher runs on each rank for `--tp N`). A worker
rank (RANK > 0 under the launcher) exits 0 after an error line of its own: the driver meets the same
error and its status is the run's (commands/tp_cmd.py)."""

import os
import sys

from localllm.cli import app


def main() -> None:
    try:
        app()
    except SystemExit as e:
        if os.environ.get("RANK", "0") != "0" and e.code not in (0, None):
            sys.exit(0)
        raise


if __name__ == "__main__":
    main()
