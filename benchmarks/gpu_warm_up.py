"""What the warm-up at load saves: a fresh process's first requests, with and without it.

    MLX_PTX_CACHE_DIR=/tmp/ptx-cold python benchmarks/gpu_warm_up.py --shape gemma-3-270m --mode cold
    MLX_PTX_CACHE_DIR=/tmp/ptx-warm python benchmarks/gpu_warm_up.py --shape gemma-3-270m --mode warm

A random-weight target at a real shape (bf16) and a random drafter, `speculation: auto` as a server
runs it. `--mode warm` runs `warm_up.warm_up` first, as `loading.load_model` does on a GPU, and
reports its seconds; `cold` does not. Then three requests (prompts of 500, 700 and 2000 tokens; 64,
64 and 128 tokens out), each one's wall time. MLX compiles each variant of our CUDA kernels on its
first use and caches the PTX on disk (`MLX_PTX_CACHE_DIR`): an empty cache directory per mode is a
fresh machine. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUESTS = ((500, 64), (700, 64), (2000, 128))  # (prompt tokens, tokens out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma-3-270m")
    parser.add_argument("--mode", choices=("cold", "warm"), required=True)
    args = parser.parse_args()
    import mlx.core as mx

    from dflash_core.engine import Engine
    from dflash_core.random_models import ByteTokenizer, parse_shape, random_drafter, random_target
    from dflash_core.warm_up import warm_up

    started = time.perf_counter()
    name, tiny = parse_shape(args.shape)
    target = random_target(name, "bf16", tiny=tiny)
    drafter = random_drafter(name, target, tiny)
    engine = Engine(target, ByteTokenizer(target.vocab_size), drafter, speculation="auto")
    mx.eval(target.model.parameters(), drafter.parameters())
    report = {"device": mx.device_info().get("device_name"), "shape": args.shape, "mode": args.mode,
              "build_s": round(time.perf_counter() - started, 2)}
    if args.mode == "warm":
        report["warm_up_s"] = round(warm_up(engine), 2)
    for i, (length, tokens) in enumerate(REQUESTS):
        prompt = [(13 * j + i + 3) % target.vocab_size for j in range(length)]
        began = time.perf_counter()
        chunks = list(engine.generate(prompt, max_tokens=tokens, stop_token_ids=set()))
        mx.synchronize()
        report[f"request{i + 1}"] = {"prompt": length, "tokens": tokens,
                                     "wall_s": round(time.perf_counter() - began, 2),
                                     "decode_tok_s": round(chunks[-1].stats.decode_tokens_per_second, 1)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
