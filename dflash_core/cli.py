"""The `dflash` command line: serve, generate, models, doctor (and bench, train)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .bench import add_bench
from .prompts import encode_rendered, render_chat
from .sampling import SamplingParams
from .settings import ConfigError, ModelSettings, Settings, config_path, load_settings


def _add_model_flags(p, *, what: str) -> None:
    p.add_argument("--config", help="config file (default: $DFLASH_CONFIG, else ./config.yaml)")
    p.add_argument("--model", help=f"a configured model name, or a target repo/path whose drafter comes from the registry ({what})")
    p.add_argument("--target", help="target model: Hugging Face repo id or local directory")
    p.add_argument("--drafter", help="DFlash drafter: repo id or local directory ('none' for the target alone); "
                        "with --model, replaces that model's drafter")
    p.add_argument("--target-revision")
    p.add_argument("--drafter-revision")


def settings_from_args(args) -> Settings:
    """config file < CLI flags. `--target` replaces the configured models by that one."""
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
        if args.drafter:  # e.g. --model gemma-3-270m --drafter none: the same model, target alone
            drafter = None if args.drafter.lower() == "none" else args.drafter
            spec = spec.model_copy(update={"drafter": drafter, "drafter_revision": args.drafter_revision})
        others = [m for m in settings.models if m.name != spec.name]
        return settings.model_copy(update={"models": [spec] + others, "default_model": spec.name})
    return settings


def model_name(target: str) -> str:
    path = Path(target).expanduser()
    return path.name if path.exists() else target


# ---------------------------------------------------------------------------------- generate


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text once (speculative unless --no-speculative)")
    _add_model_flags(p, what="default: the config's default model")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-speculative", action="store_true", help="decode with the target alone")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from .loading import load_configured

    settings = settings_from_args(args)
    spec = settings.model()
    # Target-alone decoding keeps MLX's CUDA graphs, speculative decoding does without them.
    decoding = spec.model_copy(update={"drafter": None}) if args.no_speculative else spec
    settings.model_copy(update={"models": [decoding]}).apply_backend_settings()
    engine = load_configured(spec, settings.prefill_chunk).engine
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    tokenizer = engine.tokenizer
    if args.chat:  # rendered as the server renders a chat request
        kwargs = settings.defaults.model_dump(include={"enable_thinking"}, exclude_none=True)
        tokens = encode_rendered(tokenizer, render_chat(
            tokenizer, [{"role": "user", "content": text}], **{**kwargs, **spec.chat_template_kwargs}))
    else:
        tokens = tokenizer.encode(text)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed
    )
    pieces, token_ids, last = [], [], None
    for chunk in engine.generate(
        tokens, max_tokens=args.max_tokens, sampling=sampling, speculative=not args.no_speculative
    ):
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


def _summary(stats: dict) -> str:
    line = (
        f"prompt {stats['prompt_tokens']} tok in {stats['prefill_seconds']:.2f}s | "
        f"generated {stats['generated_tokens']} tok at {stats['decode_tokens_per_second']:.1f} tok/s"
    )
    if stats["speculative"]:
        return line + f" | {stats['tokens_per_cycle']:.2f} tokens/cycle over {stats['cycles']} cycles"
    return line + f" | speculative off: {stats['speculative_off_reason']}"


# ------------------------------------------------------------------------------------- serve


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server (default model: config.yaml's)")
    _add_model_flags(p, what="served first; other configured models stay available")
    p.add_argument("--name", help="model name clients send with --target (default: the target's name)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require Authorization: Bearer KEY")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    import uvicorn

    from server.app import create_app

    settings = settings_from_args(args)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key)) if v is not None}
    settings = settings.model_copy(update={"server": settings.server.model_copy(update=updates)})
    settings.apply_backend_settings()
    uvicorn.run(create_app(settings), host=settings.server.host, port=settings.server.port, log_level="info")
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
    print(f"{'source':<9} {'name':<34} {'drafter':<36} {'target on disk':>15} {'drafter on disk':>16}")
    for r in rows:
        print(f"{r['source']:<9} {r['name']:<34} {str(r['drafter']):<36} {_size(r['target_bytes']):>15} "
              f"{_size(r['drafter_bytes']):>16}")
    return 0


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="MLX versions, backend, device, memory, kernels, model cache and hub")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-hub", action="store_true", help="do not try to reach the Hugging Face hub")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    from .doctor import doctor_report

    report = doctor_report(check_hub=not args.no_hub)
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
