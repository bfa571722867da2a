"""`dflash train`'s data generation speed: the target's greedy responses to many prompts, generated
one at a time and with rows stepping together, through the engine's batching
(`batching.generate_together`) and mlx-lm's `BatchGenerator` (`dflash train --generator`), in one
run, with the outputs compared.

    python benchmarks/train_data.py --prompts 32 --max-tokens 64 --batches 1,4,16 --out train_data.json
    python benchmarks/train_data.py --prompts 512 --max-tokens 128 --batches 256 --generators engine,mlx-lm

The target is the offline demo's Gemma 3 270M unless --target names another; prompts are the demo's
bundled prompt set (dflash_core/demo/prompts.txt), or --prompts-file's (what `dflash train --data`
reads, e.g. `dflash corpus`'s .jsonl; plain text, at most --max-prompt-tokens each, as `dflash train
--no-chat` encodes them). --profile writes a cProfile of the largest batch's run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload  # noqa: E402

preload()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="a target directory (default: the demo's Gemma 3 270M)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--prompts-file", type=Path, help="prompts as dflash train --data reads them")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--generators", type=lambda s: s.split(","), default=["engine", "mlx-lm"],
                        help="engine (dflash's batching), mlx-lm (its BatchGenerator), or both")
    parser.add_argument("--profile", type=Path, help="a cProfile of the largest batch's run (pstats format)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from dflash_core.batching import generate_together
    from dflash_core.demo import DEMO_PROMPTS, demo_target_dir
    from dflash_core.loading import load_engine
    from dflash_core.train_data import encode_prompt, engine_response, generated_tokens, mlx_lm_responses, read_prompt_records

    engine = load_engine(args.target or str(demo_target_dir()), None)
    if args.prompts_file:
        texts = [r["prompt"] for r in read_prompt_records(args.prompts_file)][: args.prompts]
        encoded = [encode_prompt(engine.tokenizer, t, False, args.max_prompt_tokens) for t in texts]
    else:
        texts = [t for t in DEMO_PROMPTS.read_text().splitlines() if t.strip()][: args.prompts]
        encoded = [engine.tokenizer.encode(t) for t in texts]
    requests = [{"prompt_tokens": tokens, "max_tokens": args.max_tokens, "speculative": False} for tokens in encoded]
    generate_together(engine, requests[:2], 2)  # warm-up: compiled blocks
    if "mlx-lm" in args.generators:
        mlx_lm_responses(engine.target.model, [requests[0]["prompt_tokens"]], 4, engine.eos_token_ids, 1)
    report = {"machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "prompts": len(requests),
              "prompt_tokens": sum(len(r["prompt_tokens"]) for r in requests), "max_tokens": args.max_tokens,
              "prompts_file": str(args.prompts_file) if args.prompts_file else None, "rows": []}
    first = None
    stops = engine.eos_token_ids
    for generator in args.generators:
        for batch in args.batches:
            profile = None
            if args.profile and batch == max(args.batches):
                import cProfile

                profile = cProfile.Profile()
                profile.enable()
            start = time.perf_counter()
            if generator == "mlx-lm":
                made = mlx_lm_responses(engine.target.model, [r["prompt_tokens"] for r in requests], args.max_tokens,
                                        stops, batch)
            else:  # with the stop token that ended a response, as dflash train keeps it
                made = [engine_response(chunks) for chunks in generate_together(engine, requests, batch)]
            seconds = time.perf_counter() - start
            if profile is not None:
                profile.disable()
                profile.dump_stats(str(args.profile.with_name(f"{args.profile.stem}_{generator}{args.profile.suffix}")))
            first = made if first is None else first  # the first run's outputs: what every other is compared with
            tokens = sum(generated_tokens(o, stops) for o in made)
            row = {"generator": generator, "batch": batch, "seconds": seconds, "tokens": tokens,
                   "tokens_per_second": tokens / seconds,
                   "same_responses_as_first_run": sum(a == b for a, b in zip(made, first))}
            report["rows"].append(row)
            print(f"{generator:>6} batch {batch:>3}: {tokens} tokens in {seconds:6.1f} s = "
                  f"{row['tokens_per_second']:7.1f} tok/s (responses the same as the first run's: "
                  f"{row['same_responses_as_first_run']} of {len(made)})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
