"""The `dflash` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .sampling import SamplingParams


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text once (speculative unless --no-speculative)")
    p.add_argument("--target", required=True, help="target model: local directory or Hugging Face repo id")
    p.add_argument("--drafter", help="DFlash drafter: local directory or Hugging Face repo id")
    p.add_argument("--target-revision")
    p.add_argument("--drafter-revision")
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
    from .loading import load_engine

    engine = load_engine(
        args.target, args.drafter, target_revision=args.target_revision, drafter_revision=args.drafter_revision
    )
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    tokenizer = engine.tokenizer
    if args.chat:
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
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


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("--config", help="config file (default: $DFLASH_CONFIG, else ./config.yaml)")
    p.add_argument("--target", help="serve this target (repo id or path) instead of the configured models")
    p.add_argument("--drafter", help="its DFlash drafter (repo id or path)")
    p.add_argument("--name", help="model name clients send (default: the target's name)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require Authorization: Bearer KEY")
    p.set_defaults(func=run_serve)


def serve_settings(args):
    from .settings import ModelSettings, config_path, load_settings

    settings = load_settings(config_path(args.config))
    server = settings.server.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key)) if v is not None}
    )
    settings = settings.model_copy(update={"server": server})
    if args.target:
        name = args.name or model_name(args.target)
        model = ModelSettings(name=name, target=args.target, drafter=args.drafter)
        settings = settings.model_copy(update={"models": [model], "default_model": name})
    elif args.drafter:
        raise ValueError("--drafter needs --target")
    if not settings.models:
        raise ValueError("no model to serve: pass --target (and --drafter) or configure models in config.yaml")
    return settings


def model_name(target: str) -> str:
    path = Path(target).expanduser()
    return path.name if path.exists() else target


def run_serve(args) -> int:
    import uvicorn

    from server.app import create_app

    settings = serve_settings(args)
    uvicorn.run(create_app(settings), host=settings.server.host, port=settings.server.port, log_level="info")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="Lossless DFlash speculative decoding on MLX")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # Configuration and checkpoint problems: one clear line, no traceback.
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
