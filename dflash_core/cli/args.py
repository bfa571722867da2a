"""What several subcommands share: the model flags, their reading into Settings, argparse types."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..settings import ConfigError, ModelSettings, Settings, config_path, load_settings


def add_model_flags(p, *, what: str) -> None:
    p.add_argument("--config", help="config file (default: $DFLASH_CONFIG, else ./config.yaml)")
    p.add_argument("--model", help="a configured model name, or a target repo/path whose drafter comes from the registry "
                                   f"({what})")
    p.add_argument("--target", help="target model: Hugging Face repo id or local directory")
    p.add_argument("--drafter", help="DFlash drafter: repo id or local directory ('none' for the target alone); "
                        "with --model, replaces that model's drafter")
    p.add_argument("--target-revision")
    p.add_argument("--drafter-revision")
    p.add_argument("--speculation", choices=["auto", "on", "off"],
                   help="auto (default): cycles only while they beat plain target steps here; on: always; off: the target alone")


def add_distributed_flag(p) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="shard the target over the ranks this was started on with `mlx.launch` (every rank runs "
                        "the same command; rank 0 does the talking: docs/distributed.md)")


def distributed_channel(args):
    """The group's Channel with --distributed (on every rank), else None."""
    if not getattr(args, "distributed", False):
        return None
    from ..distributed import Channel, init_group

    return Channel(init_group())


def settings_from_args(args) -> Settings:
    """config file < CLI flags. `--target` replaces the configured models by that one."""
    settings = models_from_args(args)
    if getattr(args, "speculation", None):  # every model's mode
        models = [m.model_copy(update={"speculation": args.speculation}) for m in settings.models]
        settings = settings.model_copy(update={"models": models})
    return settings


def models_from_args(args) -> Settings:
    settings = load_settings(config_path(args.config))
    if args.target:
        drafter = args.drafter or "auto"
        spec = ModelSettings(
            name=getattr(args, "name", None) or model_name(args.target),
            target=args.target,
            target_revision=args.target_revision,
            drafter=None if drafter.lower() == "none" else drafter,
            drafter_revision=args.drafter_revision,
        )
        return settings.model_copy(update={"models": [spec], "default_model": spec.name})
    if args.drafter and not args.model:
        raise ConfigError("--drafter needs --target or --model")
    if args.model:
        spec = settings.model(args.model)
        updates = {}
        if args.drafter:  # e.g. --model gemma-3-270m --drafter none: the same model, target alone
            updates["drafter"] = None if args.drafter.lower() == "none" else args.drafter
            updates["drafter_revision"] = args.drafter_revision
        elif args.drafter_revision:
            updates["drafter_revision"] = args.drafter_revision
        if args.target_revision:
            updates["target_revision"] = args.target_revision
        spec = spec.model_copy(update=updates)
        # The others stay available on request, but are not loaded (or downloaded) at start:
        # `--model gemma-3-270m` must work offline whatever else config.yaml lists.
        others = [m.model_copy(update={"load_at_start": False}) for m in settings.models if m.name != spec.name]
        return settings.model_copy(update={"models": [spec] + others, "default_model": spec.name})
    return settings


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    (value,) = positive_ints(text)
    return value


def model_name(target: str) -> str:
    path = Path(target).expanduser()
    return path.resolve().name if path.exists() else target  # resolved: `.` has no name of its own
