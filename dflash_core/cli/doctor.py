"""`dflash doctor`: what this machine and installation can do."""

from __future__ import annotations

import json

from ..settings import config_path, load_settings


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="MLX versions, backend, device, memory, kernels, model cache and hub")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-hub", action="store_true", help="do not try to reach the Hugging Face hub")
    p.add_argument("--config")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    from ..doctor import doctor_report

    report = doctor_report(check_hub=not args.no_hub, settings=load_settings(config_path(args.config)))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        print(f"{key:<18} {value}")
    return 0
