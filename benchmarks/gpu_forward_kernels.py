"""How much of a decode step, a 16-token verify forward and a draft is kernel time, and of what kind.

Wall time per forward in this process (synchronised medians), then, with --ncu, the same forwards
launched after marker kernels so that an ncu trace (parse_ncu.py) gives each forward's kernels:
their count and their summed kernel-only time by kind (matmul, attention, gated delta, other).
Wall minus summed kernel time is what launches, gaps between kernels and host work cost.

    MLX_USE_CUDA_GRAPHS=0 python benchmarks/gpu_forward_kernels.py --model qwen3.5-9b --context 1024
    MLX_USE_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum,launch__grid_size -o fwd \\
        python benchmarks/gpu_forward_kernels.py --model qwen3.5-9b --context 1024 --ncu > fwd_configs.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_m_stream_cuda as stream  # noqa: E402
from gpu_cycle import PATHS, build_drafter, build_target, per_iteration_ms  # noqa: E402
from gpu_profile import prefilled  # noqa: E402

from dflash_core.loading import parameter_bytes  # noqa: E402


def forwards(adapter, drafter, snapshot):
    taps = drafter.config.target_layer_ids
    one = mx.array([[7]])
    block = mx.random.randint(0, adapter.vocab_size, (1, 16))
    cache, _ = snapshot.restore()

    def decode():
        return [adapter.forward(one, cache).logits]

    def verify():
        v = adapter.forward(block, cache, taps, record=True)
        adapter.rollback(cache, v.rollback, keep=16)
        return [v.logits, v.tapped_hidden]

    def draft():  # a cycle's drafter call: 5 accepted positions' taps into its context, then 16 drafts
        _, context_cache = snapshot.restore()
        drafter.add_context(taps16[:, :5], context_cache)
        return [drafter.propose(mx.array([1]), adapter, context_cache)]

    taps16 = mx.random.normal((1, 16, len(taps) * adapter.hidden_size)).astype(adapter.dtype)
    return {"decode": decode, "verify16": verify, "draft16": draft}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-9b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--path", default="dflash", choices=sorted(PATHS), help="kernel options (gpu_cycle.py's --paths)")
    args = parser.parse_args()
    adapter = build_target(args.model, args.quant, None, False).with_kernels(PATHS[args.path])
    drafter = build_drafter(args.model, adapter, False).with_kernels(PATHS[args.path])
    snapshot = prefilled(adapter, drafter, args.context)
    weight_bytes = parameter_bytes(adapter.model)
    for index, (name, fn) in enumerate(forwards(adapter, drafter, snapshot).items()):
        for _ in range(3):
            mx.eval(fn())  # compiled blocks traced before anything is measured
        row = {"index": index, "model": args.model, "quant": args.quant, "context": args.context, "path": name,
               "weight_bytes": weight_bytes, "launches": 3, "kernels": args.path}
        if args.ncu:
            mx.eval(stream.marker(index))
            for _ in range(3):
                mx.eval(fn())
            mx.eval(stream.marker(stream.IGNORE))
        else:
            row["wall_ms"] = round(per_iteration_ms(fn, iters=20), 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
