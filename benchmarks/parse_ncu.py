"""Match an ncu trace of `gpu_small_m.py --ncu` to its configurations and summarise each:
kernel-only time per launch (no launch gaps), TB/s of weight bytes, DRAM bytes read against the
weight's bytes, warps active, registers per thread.

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
        sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \\
        -o trace python benchmarks/gpu_small_m.py --ncu > configs.jsonl
    ncu --import trace.ncu-rep --csv --page raw > trace.csv
    python benchmarks/parse_ncu.py --trace trace.csv --configs configs.jsonl --out ncu_small_m.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict

IGNORE = 65535  # small_m_stream_cuda.IGNORE: launches after it belong to no configuration


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


SCALE = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def kind(kernel_name: str) -> str:
    """A kernel's kind by its name: MLX's GEMV and cuBLAS's GEMMs (nvjet, sm90 xmma, cutlass) and our
    small-M kernels are matmuls; then attention, the gated delta recurrence, the rest."""
    name = kernel_name.lower()
    if any(s in name for s in ("gemv", "gemm", "nvjet", "xmma", "cutlass", "small_m", "qmm", "quantized_matmul")):
        return "matmul"
    if any(s in name for s in ("sdpa", "attention", "cudnn", "flash", "softmax")):
        return "attention"
    if "gated_delta" in name:
        return "gated_delta"
    return "other"


def summarise(trace_rows: list[dict], configs: dict[int, dict], units: dict) -> list[dict]:
    seconds_per = SCALE[units["gpu__time_duration.sum"]]
    bytes_per = SCALE.get(units.get("dram__bytes_read.sum", ""), 1.0)
    launches = defaultdict(list)
    current = None
    for row in trace_rows:
        if "dflash_marker" in row["Kernel Name"]:
            current = int(number(row["launch__grid_size"])) - 1
            current = None if current == IGNORE else current
            continue
        if current is not None:
            launches[current].append(row)
    summary = []
    for index, config in sorted(configs.items()):
        rows = launches.get(index, [])
        if not rows:
            continue
        n = config.get("launches", 3)  # products (or forwards) launched after the marker
        per_launch = len(rows) / n  # kernels per product (a split-K GEMM launches more than one)
        seconds = sum(number(r["gpu__time_duration.sum"]) for r in rows) / n * seconds_per
        dram = sum(number(r.get("dram__bytes_read.sum", "nan")) for r in rows) / n * bytes_per
        main = max(rows, key=lambda r: number(r["gpu__time_duration.sum"]))
        by_kind, by_name = defaultdict(float), defaultdict(float)
        for r in rows:
            by_kind[kind(r["Kernel Name"])] += number(r["gpu__time_duration.sum"]) / n * seconds_per * 1e6
            by_name[r["Kernel Name"][:40]] += 1 / n
        summary.append({**config, "kernels_per_product": per_launch, "launches": len(rows), "us": round(seconds * 1e6, 2),
                        "tb_s": round(config["weight_bytes"] / seconds / 1e12, 3),
                        "dram_read_over_weight": round(dram / config["weight_bytes"], 3),
                        "warps_active_pct": number(main.get("sm__warps_active.avg.pct_of_peak_sustained_active", "nan")),
                        "registers": number(main.get("launch__registers_per_thread", "nan")),
                        "kernel": main["Kernel Name"][:80], "grid": main["launch__grid_size"],
                        "us_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items())},
                        "launches_by_name": {k: round(v, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}})
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    with open(args.trace) as f:
        lines = [line for line in f if line.startswith('"')]
    reader = list(csv.DictReader(lines))
    trace_rows = [r for r in reader[1:] if r.get("Kernel Name")]  # the first row holds units
    configs = {}
    with open(args.configs) as f:
        for line in f:
            if line.startswith("{"):
                config = json.loads(line)
                configs[config["index"]] = config
    summary = summarise(trace_rows, configs, reader[0])
    for row in summary:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
