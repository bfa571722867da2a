"""`dflash generate`: one generation from the command line, with its stats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..prompts import encode_rendered, render_chat
from ..sampling import SamplingParams
from ..settings import ConfigError
from .args import add_distributed_flag, add_model_flags, distributed_channel, settings_from_args


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text once (speculative unless --no-speculative)")
    add_model_flags(p, what="default: the config's default model")
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
    add_distributed_flag(p)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from ..loading import load_configured

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
    channel = distributed_channel(args)
    engine = load_configured(decoding, settings.prefill_chunk, group=channel and channel.group).engine
    if args.no_speculative:
        engine.drafter_off_reason = "disabled by request"  # not "no drafter configured": one is
    quiet = False
    if channel is not None:  # every rank generates; rank 0 says what
        from ..distributed import LockstepEngine

        engine, quiet = LockstepEngine(engine, channel), not channel.leader
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
        if not (args.json or quiet):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    stats = last.stats.as_dict()
    stats["finish_reason"] = last.finish_reason
    if quiet:
        return 0
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
