"""`dflash models`: configured models and the registry, and what is on disk."""

from __future__ import annotations

import json

from ..settings import config_path, load_settings


def add_models(sub) -> None:
    p = sub.add_parser("models", help="configured models and the built-in registry; which are on disk")
    p.add_argument("--config")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_models)


def _size(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def run_models(args) -> int:
    from ..doctor import models_report

    rows = models_report(load_settings(config_path(args.config)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("source", "name", "drafter", "target on disk", "drafter on disk")] + [
        (r["source"], r["name"], str(r["drafter"]), _size(r["target_bytes"]), _size(r["drafter_bytes"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]  # long local paths widen their column
    for row in table:
        print("  ".join([cell.ljust(w) for cell, w in zip(row[:3], widths)] +
                        [cell.rjust(w) for cell, w in zip(row[3:], widths[3:])]).rstrip())
    return 0
