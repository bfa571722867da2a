"""The reference line for gpu_small_m.py: cuBLAS through PyTorch at the same shapes and row
counts, replayed from a CUDA graph and timed with CUDA events (what the card allows a library
GEMM), plus a device-to-device copy. Needs only torch (the GPU machine's own python3).

    python3 benchmarks/torch_small_m.py --out torch_small_m.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from small_m_shapes import ROTATION_BYTES, ROWS, SHAPES, emitter


def graph_seconds(fn, reps=20) -> float:
    """Median seconds of one replay of a CUDA graph of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    emit = emitter(args.out)

    src = torch.randn(int(ROTATION_BYTES // 2), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    emit({"section": "ceiling", "op": "torch copy (read+write)",
          "tb_s": 2 * src.nbytes / graph_seconds(lambda: dst.copy_(src)) / 1e12})
    for name, (N, K) in SHAPES.items():
        count = max(2, int(ROTATION_BYTES // (2 * N * K)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(count)]
        nbytes = sum(w.nbytes for w in ws)
        row = {"section": "stream", "shape": name}
        for M in (*ROWS, 64, 128):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row[f"torch_M{M}"] = round(nbytes / graph_seconds(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / 1e12, 3)
        emit(row)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
