"""What a verify of M rows costs against a one-row decode step, for one weight matrix.

    python benchmarks/cpu_matmul.py                       # the demo's LM head: 262144 x 640, float32
    python benchmarks/cpu_matmul.py --rows 4096 --cols 4096 --dtype bfloat16
    python benchmarks/cpu_matmul.py --bits 4 --batch-rows 1      # MLX's quantized_matmul, group 32
    python benchmarks/cpu_matmul.py --half-head                  # dflash's float16 CPU LM head kernel

Times `x @ W.T` for M = 1, 2, 4, 8, 16 rows (median of --repeats after a warm-up) on MLX's default
device and prints each time with its ratio to M = 1. A backend that reads the weights once per
product keeps the ratio near 1 for small M (what DFlash relies on); one whose cost grows with M
(MLX's CPU backend here) makes a 16-token verify cost about 16 decode steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload, provider  # noqa: E402

preload()  # the fast BLAS dflash runs with, loaded before MLX

import mlx.core as mx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=262144, help="output features (the vocabulary for an LM head)")
    parser.add_argument("--cols", type=int, default=640, help="input features (the hidden size)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch-rows", default="1,2,4,8,16", help="the values of M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bits", type=int, choices=(4, 8), help="quantize the weight (affine, --group-size)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--half-head", action="store_true",
                        help="the float32 weight through dflash's float16 CPU head kernel (dflash_core/kernels/cpu_head.py)")
    args = parser.parse_args()

    dtype = getattr(mx, args.dtype)
    weight = mx.random.normal((args.rows, args.cols)).astype(dtype)
    mx.eval(weight)
    product = lambda x: x @ weight.T  # noqa: E731
    if args.bits:
        quantized = mx.quantize(weight, group_size=args.group_size, bits=args.bits)
        mx.eval(quantized)
        product = lambda x: mx.quantized_matmul(x, *quantized, transpose=True, group_size=args.group_size,  # noqa: E731
                                                bits=args.bits)
    if args.half_head:
        from dflash_core.kernels.cpu_head import HalfHead, library

        if args.dtype != "float32" or args.bits or library() is None:
            raise SystemExit("--half-head: a float32 weight, and a machine the kernel runs on (dflash doctor)")
        product = HalfHead(weight, library())
    results = {}
    for m in (int(v) for v in args.batch_rows.split(",")):
        x = mx.random.normal((m, args.cols)).astype(dtype)
        mx.eval(product(x))  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            mx.eval(product(x))
            times.append(time.perf_counter() - start)
        results[m] = statistics.median(times)
    one = results[min(results)]
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "shape": [args.rows, args.cols],
                      "dtype": args.dtype, "bits": args.bits, "half_head": args.half_head, "blas": provider()}))
    for m, seconds in results.items():
        print(f"M={m:>3}: {seconds * 1e3:8.1f} ms  ({seconds / one:5.1f}x M=1)")


if __name__ == "__main__":
    main()
