"""Device time of a batched GatedDeltaNet rollback's gathers, in the forms it could take.

    python benchmarks/rollback_gather.py --rows 8 --out rollback_gather.json

A verify with step states keeps, per GatedDeltaNet layer, the state after every step [R, T, Hv, Dv,
Dk] (float32) and the conv inputs [R, T + K - 1, C]; a batched rollback (`Qwen35Adapter.rollback_rows`)
takes each row's state after its kept steps and its conv window, in every layer. Timed for
--layers layers at once (random arrays at the Qwen3.5-9B shape by default; --tiny for a CPU check),
median of --repeats: building the ops (host) and building plus evaluating them, for the state
taken as `kept[rows, keeps - 1]` (a gather over five dimensions: MLX's gather kernel does index
arithmetic per element over every dimension; the engine's form before 2026-12-05), as `mx.take`
over the states laid out [R * T, size] (the engine's form since, with `KernelOptions.step_deltas` off),
and the conv windows' gather.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def timed(fn, repeats: int) -> dict:
    import mlx.core as mx

    builds, totals = [], []
    for i in range(repeats + 2):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        if i >= 2:  # (the first runs compile the kernels)
            builds.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
    return {"build_ms": statistics.median(builds) * 1e3, "total_ms": statistics.median(totals) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24, help="GatedDeltaNet layers (Qwen3.5-9B: 24)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="small arrays (checks the script on a CPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import mlx.core as mx

    R, T, K = args.rows, 16, 4
    Hv, Dv, Dk, C = (4, 8, 8, 64) if args.tiny else (32, 128, 128, 2 * 16 * 128 + 32 * 128)  # Qwen3.5-9B
    kept = [mx.random.normal((R, T, Hv, Dv, Dk)) for _ in range(args.layers)]
    conv = [mx.random.normal((R, T + K - 1, C)).astype(mx.bfloat16) for _ in range(args.layers)]
    keeps = mx.array([1 + (5 * r + 3) % (T - 1) for r in range(R)])  # 1..T-1, a different one per row
    rows = mx.arange(R)
    window_at = keeps[:, None] + mx.arange(K - 1)[None]
    flat = rows * T + keeps - 1
    mx.eval(kept, conv, window_at, flat)
    forms = {
        "state, kept[rows, keeps - 1]": lambda: [k[rows, keeps - 1] for k in kept],
        "state, take over [R * T, size]": lambda: [mx.take(k.reshape(R * T, -1), flat, axis=0).reshape(R, Hv, Dv, Dk)
                                                   for k in kept],
        "conv window": lambda: [c[rows[:, None], window_at] for c in conv],
    }
    first, second = forms["state, kept[rows, keeps - 1]"](), forms["state, take over [R * T, size]"]()
    assert all(mx.array_equal(a, b).item() for a, b in zip(first, second)), "the two forms differ"
    report = {"device": mx.device_info().get("device_name"), "date": time.strftime("%Y-%m-%d"), "rows": R,
              "layers": args.layers, "state_shape": [R, T, Hv, Dv, Dk], "forms": {}}
    for name, fn in forms.items():
        report["forms"][name] = timed(fn, args.repeats)
        print(f"{name:32s} build {report['forms'][name]['build_ms']:.2f} ms, total {report['forms'][name]['total_ms']:.2f} ms",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
