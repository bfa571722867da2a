"""A verify that records each GatedDeltaNet step's delta instead of its state, and a rollback that
replays the kept steps' rank-one updates (`KernelOptions.step_deltas`), against step states.

    python benchmarks/gated_delta_deltas.py --rows 1,8,16 --out gated_delta_deltas.json

Why. A verify with step states (`gated_delta_cuda`, step_states=True) writes the float32 state after
every step, [B, T, Hv, Dv, Dk]: for the Qwen3.5-9B shape 2 MB a step and row, so 268 MB a layer and
6.4 GB a round for 8 rows of 16 tokens, and the rollback gathers each row's state after its kept
steps from them. But a step changes the state by a rank-one update whose factors are already at hand:

    s_t = s_{t-1} * g_t + k_t (x) delta_t,   delta_t = (v_t - (s_{t-1} * g_t) k_t) * beta_t

with g_t a scalar per head, k_t the step's key (an input) and delta_t one float per state row. So a
verify can record delta_t only ([B, T, Hv, Dv], 1/Dk of the states: 2 MB a layer for 8 rows), and
a rollback to `keep` steps recomputes s_keep from the state before the verify (kept anyway) in
`keep` element-wise updates, no reductions: the same multiply and fused multiply-add per element as
the verify, so the same bits, if both round alike. Both kernels (dflash_core/kernels/gated_delta_cuda.py)
write the two operations as CUDA's explicit `__fmul_rn` and `__fmaf_rn`, which the compiler never
contracts or reorders. (The first run of this script, 2026-12-05, built them here by editing the
engine's kernel, which then left the roundings to the compiler; `same_as_engine` compared the two.)

What it checks and measures (random inputs at the 9B's linear-attention shape, T = 16):
- `replay_exact`: for every keep 1..T-1 and every row (each row keeps a different number), the
  replayed state equals, bit for bit, the final state of the same kernel run on the first `keep`
  steps alone (the property the engine's rollback needs: the state as if only those tokens had been
  fed, which a decode step would have produced);
- `same_as_engine`: whether the delta kernel's outputs (y and the final state) equal the plain
  kernel's bit for bit;
- per --rows, ms for --layers layers: the engine's verify recurrence with step states plus its
  rollback gather (`mx.take`, as `Qwen35Adapter.rollback_rows`), against the delta kernel plus the
  replay, each evaluated and synchronised, median of --repeats.
Needs CUDA (the kernels are `mx.fast.cuda_kernel`s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollback_gather import timed  # noqa: E402

from dflash_core.kernels import gated_delta as gd  # noqa: E402


def inputs(B: int, T: int, seed: int):
    import mlx.core as mx

    Hk, Hv, Dk, Dv = 16, 32, 128, 128  # Qwen3.5-9B's linear attention
    key = mx.random.key(seed)
    ks = mx.random.split(key, 6)
    q = (mx.random.normal((B, T, Hk, Dk), key=ks[0]) / Dk**0.5).astype(mx.bfloat16)
    k = (mx.random.normal((B, T, Hk, Dk), key=ks[1]) / Dk**0.5).astype(mx.bfloat16)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(mx.bfloat16)
    g = mx.exp(-mx.random.uniform(0.0, 0.5, (B, T, Hv), key=ks[3]))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=ks[4])).astype(mx.bfloat16)
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[5]) * 0.1
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def check(T: int) -> dict:
    import mlx.core as mx

    from dflash_core.kernels import gated_delta_cuda as engine

    B = T - 1  # row b keeps b + 1 steps: every keep 1..T-1 once
    q, k, v, g, beta, state = inputs(B, T, 0)
    y, final, deltas = gd.gated_delta_deltas(q, k, v, g, beta, state)
    replayed = gd.replay(k, g, deltas, state, list(range(1, T)))
    exact = []
    for b in range(B):
        keep = b + 1
        one = [x[b : b + 1, :keep] for x in (q, k, v, g, beta)]
        _, alone, _ = gd.gated_delta_deltas(*one, state[b : b + 1])
        exact.append(mx.array_equal(replayed[b : b + 1], alone).item())
    y_engine, final_engine = engine.gated_delta_cuda(q, k, v, g, beta, state)
    return {"T": T, "replay_exact_per_keep": exact, "replay_exact": all(exact),
            "same_as_engine": mx.array_equal(y, y_engine).item() and mx.array_equal(final, final_engine).item()}


def measure(B: int, layers: int, repeats: int) -> dict:
    import mlx.core as mx

    from dflash_core.kernels import gated_delta_cuda as engine

    T = 16
    q, k, v, g, beta, _ = inputs(B, T, 1)
    states = [mx.random.normal((B, 32, 128, 128), key=mx.random.key(100 + i)) * 0.1 for i in range(layers)]
    mx.eval(states)
    keeps = [1 + (5 * b + 3) % (T - 1) for b in range(B)]
    flat = mx.arange(B) * T + mx.array(keeps) - 1

    def engine_way():  # the verify with step states, then the rollback's take (the engine's way until deltas)
        out = []
        for s in states:
            y, final, kept = engine.gated_delta_cuda(q, k, v, g, beta, s, step_states=True)
            out += [y, final, mx.take(kept.reshape(B * T, -1), flat, axis=0)]
        return out

    def delta_way():  # the verify recording deltas, then the replay
        out = []
        for s in states:
            y, final, deltas = gd.gated_delta_deltas(q, k, v, g, beta, s)
            out += [y, final, gd.replay(k, g, deltas, s, keeps)]
        return out

    def verify_only(step_states: bool):
        return lambda: [engine.gated_delta_cuda(q, k, v, g, beta, s, step_states=step_states) for s in states]

    runs = {"engine_step_states_and_take_ms": engine_way, "deltas_and_replay_ms": delta_way,
            "engine_verify_with_step_states_ms": verify_only(True), "engine_verify_without_step_states_ms": verify_only(False),
            "deltas_verify_only_ms": lambda: [gd.gated_delta_deltas(q, k, v, g, beta, s) for s in states]}
    return {"rows": B, "layers": layers, **{name: timed(run, repeats)["total_ms"] for name, run in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=24, help="GatedDeltaNet layers (Qwen3.5-9B: 24)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import mlx.core as mx

    from dflash_core.kernels import backend

    if backend() != "cuda":
        raise SystemExit("gated_delta_deltas.py needs MLX's CUDA backend (its kernels are mx.fast.cuda_kernel)")
    report = {"device": mx.device_info().get("device_name"), "date": time.strftime("%Y-%m-%d"),
              "check": check(16), "timings": []}
    print(json.dumps(report["check"]), flush=True)
    for B in args.rows:
        row = measure(B, args.layers, args.repeats)
        report["timings"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
