#!/usr/bin/env bash
# The 4-bit half of gpu_small_m.sh, in one call on the GPU machine: kernel-only times (ncu) of
# MLX's quantized matmul and ours at the Qwen3.5-9B shapes, then a whole 4-bit decode step and
# verify-16: wall time and kernel-only time by kind. Results under ${OUT:-small_m_out}/.
# SWEEP=1: our kernel also at every (NW warps splitting K, U chunks ahead) of gpu_small_m.py's
# Q4_SWEEP beside launch_shape's choice, at ROWS (default 1,16), and no whole forward.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-small_m_out}"
mkdir -p "$out"
sweep=() rows="${ROWS:-1,4,16,32}"
if [ -n "${SWEEP:-}" ]; then sweep=(--q4-sweep) rows="${ROWS:-1,16}"; fi
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
MLX_USE_CUDA_GRAPHS=0 "$NCU" --clock-control none -f -o /tmp/q4_trace \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
  -k 'regex:dflash|gemv|gemm|xmma|cutlass|sm90|qmm|qmv' \
  python3 benchmarks/gpu_small_m.py --ncu --quant 4bit "${sweep[@]}" --rows "$rows" \
  > "$out/q4_configs.jsonl" 2> "$out/q4.log" || echo "q4 ncu failed"
"$NCU" --import /tmp/q4_trace.ncu-rep --csv --page raw > /tmp/q4_trace.csv 2>> "$out/q4.log"
python3 benchmarks/parse_ncu.py --trace /tmp/q4_trace.csv --configs "$out/q4_configs.jsonl" --out "$out/q4_ncu.json" \
  > "$out/q4_summary.jsonl" 2>> "$out/q4.log" || echo "q4 parse failed"
gzip -c /tmp/q4_trace.csv > "$out/q4_trace.csv.gz"
if [ -z "${SWEEP:-}" ]; then
MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/gpu_forward_kernels.py --quant 4bit > "$out/q4_forward_wall.jsonl" 2>> "$out/q4_forward.log"
MLX_USE_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none -f -o /tmp/q4_forward --metrics gpu__time_duration.sum,launch__grid_size \
  python3 benchmarks/gpu_forward_kernels.py --quant 4bit --ncu > "$out/q4_forward_configs.jsonl" 2>> "$out/q4_forward.log" || echo "forward ncu failed"
"$NCU" --import /tmp/q4_forward.ncu-rep --csv --page raw > /tmp/q4_forward.csv 2>> "$out/q4_forward.log"
python3 benchmarks/parse_ncu.py --trace /tmp/q4_forward.csv --configs "$out/q4_forward_configs.jsonl" \
  --out "$out/q4_forward_kernels.json" 2>> "$out/q4_forward.log"
gzip -c /tmp/q4_forward.csv > "$out/q4_forward_trace.csv.gz"
fi
python3 - "$out/q4_summary.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"].split()[0], r["M"], r["path"], r["us"], r["tb_s"], r["registers"], round(r["warps_active_pct"]), sep="\t")
PY
if [ -z "${SWEEP:-}" ]; then cat "$out/q4_forward_wall.jsonl"; fi
