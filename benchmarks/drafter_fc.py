"""The drafter's `fc` (taps -> context) by row count: through `kernels.matmul.linear` against MLX's
own product, which is what decides where `DFlashDrafter.add_context_rows` switches from one to the
other (a cycle's few taps through `linear`, a prompt's many through MLX's GEMM).

On the CPU the fast BLAS is loaded first, as `dflash serve` loads it, and `linear` takes float32
products to the fixed-order primitive (kernels/cpu_linear.py); on CUDA it takes bf16 ones of up to
32 rows to the stream kernel. Each product is evaluated alone, the minimum of `--repeats`.

    python benchmarks/drafter_fc.py --rows 16,512,2048 --out drafter_fc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload, provider  # noqa: E402

LOADED = preload()  # before anything imports MLX, as `dflash` does

import mlx.core as mx  # noqa: E402

from dflash_core.drafter import load_drafter  # noqa: E402
from dflash_core.kernels.matmul import linear  # noqa: E402


def best_ms(product, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(product())
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    from dflash_core.demo import DEMO_DRAFTER

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(DEMO_DRAFTER))
    parser.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "bfloat16")
    parser.add_argument("--rows", default="16,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    drafter = load_drafter(args.drafter, dtype=dtype)
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        taps = mx.random.normal((1, n, drafter.fc.weight.shape[1])).astype(dtype)
        mx.eval(taps)
        row = {"rows": n,
               "linear_ms": best_ms(lambda: linear(drafter.fc, taps, drafter.kernels), args.repeats),
               "mlx_ms": best_ms(lambda: drafter.fc(taps), args.repeats)}
        rows.append(row)
        print(f"{n:>6} rows: linear {row['linear_ms']:.2f} ms, MLX's product {row['mlx_ms']:.2f} ms", flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "mlx": mx.__version__,
              "blas": provider(), "dtype": args.dtype, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
