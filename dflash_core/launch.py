"""The `dflash` command's entry point: a fast BLAS first (`blas.py`), then the CLI.

Kept apart from `cli.py` because the BLAS must be loaded before anything imports MLX, and the CLI's
modules do at import.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .blas import preload

    preload()
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
