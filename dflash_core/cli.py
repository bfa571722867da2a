"""The `dflash` command line: serve, generate, models, doctor (and bench, train)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from .bench import add_bench
from .prompts import encode_rendered, render_chat
from .sampling import SamplingParams
from .settings import ConfigError, ModelSettings, ServerSettings, Settings, config_path, load_settings


def _add_model_flags(p, *, what: str) -> None:
    p.add_argument("--config", help="config file (default: $DFLASH_CONFIG, else ./config.yaml)")
    p.add_argument("--model", help=f"a configured model name, or a target repo/path whose drafter comes from the registry ({what})")
    p.add_argument("--target", help="target model: Hugging Face repo id or local directory")
    p.add_argument("--drafter", help="DFlash drafter: repo id or local directory ('none' for the target alone); "
                        "with --model, replaces that model's drafter")
    p.add_argument("--target-revision")
    p.add_argument("--drafter-revision")
    p.add_argument("--speculation", choices=["auto", "on", "off"],
                   help="auto (default): cycles only while they beat plain target steps here; on: always; off: the target alone")


def settings_from_args(args) -> Settings:
    """config file < CLI flags. `--target` replaces the configured models by that one."""
    settings = _models_from_args(args)
    if getattr(args, "speculation", None):  # every model's mode
        models = [m.model_copy(update={"speculation": args.speculation}) for m in settings.models]
        settings = settings.model_copy(update={"models": models})
    return settings


def _models_from_args(args) -> Settings:
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


# ---------------------------------------------------------------------------------- generate


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text once (speculative unless --no-speculative)")
    _add_model_flags(p, what="default: the config's default model")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    # Unset flags fall back to config.yaml (the model's `sampling`, then `defaults`), then these.
    p.add_argument("--max-tokens", type=int, help="default: config, else 512")
    p.add_argument("--temperature", type=float, help="default: config, else 0 (greedy)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-speculative", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from .loading import load_configured

    settings = settings_from_args(args)
    spec = settings.model()
    text = args.prompt if args.prompt is not None else _read_prompt(args.prompt_file)
    configured = settings.sampling_defaults(spec)  # as the server's, less generation_config.json

    def option(name, fallback):
        value = getattr(args, name)
        return value if value is not None else configured.get(name, fallback)

    sampling = SamplingParams(
        temperature=option("temperature", 0.0), top_p=option("top_p", 1.0), top_k=option("top_k", 0),
        min_p=option("min_p", 0.0), seed=args.seed,
        repetition_penalty=configured.get("repetition_penalty", 1.0),
        presence_penalty=configured.get("presence_penalty", 0.0),
        frequency_penalty=configured.get("frequency_penalty", 0.0),
    )
    max_tokens = option("max_tokens", 512)
    # Target-alone decoding keeps MLX's CUDA graphs and needs no drafter at all.
    decoding = spec.model_copy(update={"drafter": None}) if args.no_speculative else spec
    settings.model_copy(update={"models": [decoding]}).apply_backend_settings()
    engine = load_configured(decoding, settings.prefill_chunk).engine
    if args.no_speculative:
        engine.drafter_off_reason = "disabled by request"  # not "no drafter configured": one is
    tokenizer = engine.tokenizer
    if args.chat:  # rendered as the server renders a chat request
        tokens = encode_rendered(tokenizer, render_chat(
            tokenizer, [{"role": "user", "content": text}], **settings.template_defaults(spec)))
    else:
        tokens = tokenizer.encode(text)
    pieces, token_ids, last = [], [], None
    for chunk in engine.generate(tokens, max_tokens=max_tokens, sampling=sampling, speculative=not args.no_speculative):
        token_ids += chunk.token_ids
        pieces.append(chunk.text)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    stats = last.stats.as_dict()
    stats["finish_reason"] = last.finish_reason
    if args.json:
        print(json.dumps({"text": "".join(pieces), "token_ids": token_ids, "stats": stats}))
    else:
        print(file=sys.stderr)
        print(_summary(stats), file=sys.stderr)
    return 0


def _read_prompt(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the prompt file: {e}") from None


def _summary(stats: dict) -> str:
    line = (
        f"prompt {stats['prompt_tokens']} tok in {stats['prefill_seconds']:.2f}s | "
        f"generated {stats['generated_tokens']} tok at {stats['decode_tokens_per_second']:.1f} tok/s"
    )
    if stats["speculative"]:
        line += f" | {stats['tokens_per_cycle']:.2f} tokens/cycle over {stats['cycles']} cycles"
        if stats["plain_steps"]:
            line += f", {stats['plain_steps']} plain steps"
        return line + (f" ({stats['speculation_note']})" if stats["speculation_note"] else "")
    return line + f" | speculative off: {stats['speculative_off_reason']}"


# ------------------------------------------------------------------------------------- serve


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server (default model: config.yaml's)")
    _add_model_flags(p, what="served first; other configured models stay available")
    p.add_argument("--name", help="model name clients send with --target (default: the target's name)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require the key (Authorization: Bearer KEY or x-api-key: KEY)")
    p.add_argument("--allow-no-key", action="store_const", const=True, default=None,
                   help="listen on a non-loopback --host without an API key (anyone who can reach it can use it)")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from server.app import create_app
    from server.process import serve

    settings = settings_from_args(args)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                 ("allow_no_key", args.allow_no_key)) if v is not None}
    try:  # validated as config.yaml's values are (a port out of range is an error, not a traceback)
        server = ServerSettings.model_validate({**settings.server.model_dump(), **updates})
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"--{'-'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if not server.loopback:
        if not server.api_key and not server.allow_no_key:
            raise ConfigError(f"refusing to listen on {server.host} without an API key: any machine that reaches it "
                              "could use it. Set --api-key (server.api_key), or --allow-no-key (server.allow_no_key)")
        logging.getLogger("dflash").warning(
            "listening on %s:%d: reachable from other machines, %s", server.host, server.port,
            "API key required" if server.api_key else "WITHOUT an API key (--allow-no-key)")
    # A model named on the command line is what the user wants: no demo standing in for it.
    fallback = settings.demo_fallback and not (args.model or args.target)
    settings = settings.model_copy(update={"server": server, "demo_fallback": fallback})
    settings.apply_backend_settings()
    serve(create_app(settings), settings.server.host, settings.server.port, settings.server.shutdown_timeout)
    return 0


# ------------------------------------------------------------------------------ models, doctor


def add_models(sub) -> None:
    p = sub.add_parser("models", help="configured models and the built-in registry; which are on disk")
    p.add_argument("--config")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_models)


def _size(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def run_models(args) -> int:
    from .doctor import models_report

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


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="MLX versions, backend, device, memory, kernels, model cache and hub")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-hub", action="store_true", help="do not try to reach the Hugging Face hub")
    p.add_argument("--config")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    from .doctor import doctor_report

    report = doctor_report(check_hub=not args.no_hub, settings=load_settings(config_path(args.config)))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        print(f"{key:<18} {value}")
    return 0


# ------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Lossless DFlash speculative decoding on MLX")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    from .train import add_train

    for add in (add_serve, add_generate, add_models, add_doctor, add_train, add_bench):
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
