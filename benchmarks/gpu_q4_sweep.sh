#!/usr/bin/env bash
# Our 4-bit small-M kernel at every (NW warps splitting K, U chunks loaded ahead) of
# gpu_small_m.py's Q4_SWEEP, beside launch_shape's choice and MLX's quantized matmul, at the
# Qwen3.5-9B shapes: kernel-only times from Nsight Compute, one call on the GPU machine.
# Results under ${OUT:-q4_sweep_out}/ (q4_sweep_ncu.json, q4_sweep_summary.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-q4_sweep_out}"
mkdir -p "$out"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
MLX_USE_CUDA_GRAPHS=0 "$NCU" --clock-control none -f -o /tmp/q4_sweep \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
  -k 'regex:dflash|qmm|qmv|gemv|gemm' \
  python3 benchmarks/gpu_small_m.py --ncu --quant 4bit --rows "${ROWS:-1,16}" --q4-sweep \
  > "$out/q4_sweep_configs.jsonl" 2> "$out/q4_sweep.log" || echo "ncu failed"
"$NCU" --import /tmp/q4_sweep.ncu-rep --csv --page raw > /tmp/q4_sweep.csv 2>> "$out/q4_sweep.log"
python3 benchmarks/parse_ncu.py --trace /tmp/q4_sweep.csv --configs "$out/q4_sweep_configs.jsonl" \
  --out "$out/q4_sweep_ncu.json" > "$out/q4_sweep_summary.jsonl" 2>> "$out/q4_sweep.log" || echo "parse failed"
python3 - "$out/q4_sweep_summary.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"].split()[0], r["M"], r["path"], r["us"], r["tb_s"], r["registers"], round(r["warps_active_pct"]), sep="\t")
PY
