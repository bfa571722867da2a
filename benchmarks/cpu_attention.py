"""Attention on the CPU: our primitives (dflash_core/kernels/cpu_softmax.cpp, cpu_attention.cpp) against MLX's
own attention, in one process, on the offline demo pair (Gemma 3 270M, float32, and its drafter).

    python benchmarks/cpu_attention.py --contexts 512,2048 --repeats 5 --out cpu_attention.json

For each context length, alternating the two paths `--repeats` times (`ours`: the default;
`mlx`: `KernelOptions(cpu_softmax=False)`, MLX's fused attention, as before): prefill tok/s of the
context in the engine's chunks, the ms of a decode step and of a 16-token verify right after it,
and a DFlash generation's tok/s (`--max-tokens` greedy tokens after the context, the drafter
speculating on every cycle). Medians, and ours over MLX's.

`--kernels-only`: attention's two products alone (ours against MLX's matmul), the attention alone at
the demo's shape, and the softmax alone. `--exactness N`: a 16-token verify against 16 single steps
after N tokens, per path, with the BLAS this process has (`DFLASH_BLAS=reference` for MLX's bundled
one).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload  # noqa: E402

preload()  # before MLX, as `dflash` does

import mlx.core as mx  # noqa: E402

from dflash_core.bench_prompts import select_prompts  # noqa: E402
from dflash_core.cache import cache_arrays  # noqa: E402
from dflash_core.demo import DEMO_DRAFTER, demo_target_dir  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.kernels import KernelOptions  # noqa: E402
from dflash_core.loading import load_engine  # noqa: E402
from dflash_core.prefill import chunk_ends  # noqa: E402


def context_tokens(engine, length: int) -> list[int]:
    text = "\n\n".join(m["content"] for p in select_prompts() for m in p.messages if isinstance(m.get("content"), str))
    tokens = engine.tokenizer.encode(text)
    while len(tokens) < length:
        tokens = tokens + tokens
    return tokens[:length]


def forwards(target, tokens: list[int], chunk: int, steps: int = 8, verifies: int = 3) -> dict:
    """Prefill in the engine's chunks, then `steps` decode steps and `verifies` 16-token verifies
    after it (means: the cache grows by each)."""
    cache = target.make_cache(len(tokens) + steps + 16 * verifies)
    ids = mx.array(tokens, dtype=mx.int32)[None]
    began = time.perf_counter()
    begin = 0
    for end in chunk_ends(0, len(tokens), set(), chunk, None):
        out = target.forward(ids[:, begin:end], cache, (), last_logits_only=True)
        mx.eval(out.logits, cache_arrays(cache))
        begin = end
    prefill = time.perf_counter() - began
    began = time.perf_counter()
    for i in range(steps):
        mx.eval(target.forward(ids[:, i : i + 1], cache).logits, cache_arrays(cache))
    step = (time.perf_counter() - began) / steps
    began = time.perf_counter()
    for i in range(verifies):
        mx.eval(target.forward(ids[:, 16 * i : 16 * i + 16], cache).logits, cache_arrays(cache))
    verify = (time.perf_counter() - began) / verifies
    return {"prefill_tok_s": len(tokens) / prefill, "decode_step_ms": step * 1e3, "verify16_ms": verify * 1e3}


def generation(engine, target, tokens: list[int], max_tokens: int) -> float:
    run = Engine(target, engine.tokenizer, engine.drafter, prefill_chunk=engine.prefill_chunk)
    began = None
    count = 0
    for chunk in run.generate(tokens, max_tokens=max_tokens, speculation="on", stop_token_ids=set()):
        if began is None:  # from the first token: prefill is measured above
            began, count = time.perf_counter(), len(chunk.token_ids)
            continue
        count += len(chunk.token_ids)
    return (count - 1) / (time.perf_counter() - began) if began else 0.0


def kernel_rows(repeats: int) -> list[dict]:
    """Attention's two products alone ([groups, queries, keys, head_dim]: ours and MLX's matmul), the
    attention at the demo's shape (4 query heads over 1 KV head, head_dim 256: ours, `unfused_cpu`,
    and MLX's fused attention), and the softmax alone over [64, 16, 2300]: ms, medians."""
    from dflash_core.kernels.attention import unfused_cpu
    from dflash_core.kernels.cpu_extension import extension
    from dflash_core.kernels.cpu_head import default_threads

    def ms(fn) -> float:
        mx.eval(fn())
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e3

    rows = []
    # Attention's two products alone, ours (cpu_attention.cpp) against MLX's matmul (the BLAS): ours
    # first, before any BLAS call, since MKL's threads spin for 200 ms after one (KMP_BLOCKTIME).
    products = []
    for groups, queries, keys, dim in ((1, 4, 2304, 256), (1, 64, 528, 256), (1, 64, 2304, 256), (8, 32, 2048, 128)):
        q, k, v = (mx.random.normal((groups, n, dim)) for n in (queries, keys, keys))
        p = mx.softmax(mx.random.normal((groups, queries, keys)), axis=-1)
        mx.eval(q, k, v, p)
        products.append(({"products": [groups, queries, keys, dim]}, q, k, v, p))
    for row, q, k, v, p in products:
        row["ours_scores_ms"] = ms(lambda: extension().attention_scores(q, k, default_threads()))
        row["ours_values_ms"] = ms(lambda: extension().attention_values(p, v, default_threads()))
    for row, q, k, v, p in products:
        row["mlx_scores_ms"] = ms(lambda: q @ k.swapaxes(-1, -2))
        row["mlx_values_ms"] = ms(lambda: p @ v)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for queries, keys in ((1, 2304), (16, 528), (16, 2304), (512, 2048), (2048, 2048)):
        q = mx.random.normal((1, 4, queries, 256))
        k, v = mx.random.normal((1, 1, keys, 256)), mx.random.normal((1, 1, keys, 256))
        mask = mx.arange(keys)[None] <= mx.arange(keys - queries, keys)[:, None]
        mx.eval(q, k, v, mask)
        row = {"queries": queries, "keys": keys, "ours_ms": ms(lambda: unfused_cpu(q, k, v, 0.0625, mask)),
               "mlx_ms": ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.0625, mask=mask))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    scores = mx.random.normal((64, 16, 2300)) * 3
    mx.eval(scores)
    row = {"softmax": [64, 16, 2300], "ours_ms": ms(lambda: extension().softmax(scores, default_threads())),
           "mlx_ms": ms(lambda: mx.softmax(scores, axis=-1, precise=True))}
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def exactness(engine, length: int) -> list[dict]:
    """After `length` - 16 tokens of code, a 16-token verify against 16 single steps, per attention
    path: whether the logits are the same to the bit (what lossless speculation rests on), their
    largest difference, and whether every position's argmax agrees."""
    text = ("def moving_average(values, window):\n"
            "    return [sum(values[i:i+window]) / window for i in range(len(values))]\n") * 40
    tokens = engine.tokenizer.encode(text)[:length]
    rows = []
    for name, target in (("ours", engine.target), ("mlx", engine.target.with_kernels(KernelOptions(cpu_softmax=False)))):
        caches = [target.make_cache(16), target.make_cache(16)]
        for cache in caches:
            mx.eval(target.forward(mx.array([tokens[:-16]]), cache).logits)
        block = mx.array([tokens[-16:]])
        verify = target.forward(block, caches[0]).logits
        steps = mx.concatenate([target.forward(block[:, i : i + 1], caches[1]).logits for i in range(16)], axis=1)
        row = {"path": name, "bit_identical": mx.array_equal(verify, steps).item(),
               "max_difference": mx.abs(verify - steps).max().item(),
               "argmax_agrees": mx.array_equal(verify.argmax(-1), steps.argmax(-1)).item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--target", default=None, help="a converted target (default: the demo's, from the cache)")
    parser.add_argument("--drafter", default=str(DEMO_DRAFTER))
    parser.add_argument("--kernels-only", action="store_true", help="the attention alone at the demo's shape")
    parser.add_argument("--exactness", type=int, default=0, metavar="TOKENS",
                        help="only a verify against single steps after TOKENS tokens, per path, with this BLAS")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.kernels_only:
        report = {"machine": platform.processor() or platform.machine(), "mlx": mx.__version__,
                  "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/cpu_attention.py " + " ".join(sys.argv[1:]),
                  "kernels": kernel_rows(max(args.repeats, 3))}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return 0
    engine = load_engine(args.target or str(demo_target_dir()), args.drafter)
    if args.exactness:
        from dflash_core.blas import provider

        report = {"blas": provider(), "date": time.strftime("%Y-%m-%d"), "mlx": mx.__version__,
                  "command": "python benchmarks/cpu_attention.py " + " ".join(sys.argv[1:]),
                  "exactness": exactness(engine, args.exactness)}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return 0
    arms = {"ours": engine.target, "mlx": engine.target.with_kernels(KernelOptions(cpu_softmax=False))}
    report = {"machine": platform.processor() or platform.machine(), "mlx": mx.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/cpu_attention.py " + " ".join(sys.argv[1:]),
              "rows": []}
    for length in (int(c) for c in args.contexts.split(",")):
        tokens = context_tokens(engine, length)
        runs = {name: [] for name in arms}
        for _ in range(args.repeats):
            for name, target in arms.items():
                result = forwards(target, tokens, engine.prefill_chunk)
                result["dflash_tok_s"] = generation(engine, target, tokens, args.max_tokens)
                runs[name].append(result)
        row = {"context": length}
        for name, results in runs.items():
            row[name] = {key: statistics.median(r[key] for r in results) for key in results[0]}
        row["ours_over_mlx"] = {key: row["ours"][key] / row["mlx"][key] for key in row["ours"]}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
