"""The `dflash` command line, the top layer: serve, generate, models, doctor, bench, train.

All argparse lives in this package; nothing below it imports it (tests/test_layers.py checks), and
only `serve` imports the HTTP layer.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .args import model_name, positive_int, positive_ints, settings_from_args
from .bench import add_bench
from .doctor import add_doctor
from .generate import add_generate
from .models import add_models
from .serve import add_serve
from .train import add_corpus, add_train

__all__ = ["build_parser", "main", "model_name", "positive_int", "positive_ints", "settings_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Lossless DFlash speculative decoding on MLX")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_serve, add_generate, add_models, add_doctor, add_train, add_corpus, add_bench):
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # Configuration and checkpoint problems: one clear message, no traceback, exit code 2.
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
