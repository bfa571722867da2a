#!/usr/bin/env bash
# Every small-M measurement of docs/performance.md's "Small-M products against the card's limit",
# in one call on the GPU machine, results under ${OUT:-small_m_out}/: cuBLAS through torch (the
# reference line), MLX and our kernels timed in-process, then an ncu trace of kernel-only times.
#   bash benchmarks/gpu_small_m.sh [shapes for the ncu pass] [rows for the ncu pass]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-small_m_out}"
mkdir -p "$out"
ncu_shapes="${1:-gdn_in 12352x4096,attn_qkv 10240x4096,gate_up 24576x4096,down 4096x12288,out 4096x4096,lm_head 248320x4096}"
ncu_rows="${2:-1,4,16,32,128}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$out/gpu.txt"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
if [ -z "${FORWARD_ONLY:-}" ]; then
python3 benchmarks/torch_small_m.py --out "$out/torch_small_m.jsonl" > "$out/torch.log" 2>&1 || echo "torch part failed"
python3 benchmarks/gpu_small_m.py --out "$out/small_m.jsonl" > "$out/mlx.log" 2>&1 || echo "mlx part failed"
if [ -n "$NCU" ]; then
  MLX_USE_CUDA_GRAPHS=0 "$NCU" --clock-control none -f -o /tmp/small_m_trace \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
    -k 'regex:dflash|gemv|gemm|xmma|cutlass|sm90' \
    python3 benchmarks/gpu_small_m.py --ncu --shapes "$ncu_shapes" --rows "$ncu_rows" > "$out/ncu_configs.jsonl" 2> "$out/ncu.log" \
    || echo "ncu run failed"
  "$NCU" --import /tmp/small_m_trace.ncu-rep --csv --page raw > /tmp/small_m_trace.csv 2>> "$out/ncu.log"
  python3 benchmarks/parse_ncu.py --trace /tmp/small_m_trace.csv --configs "$out/ncu_configs.jsonl" \
    --out "$out/ncu_small_m.json" > "$out/ncu_summary.jsonl" 2>> "$out/ncu.log" || echo "parse failed"
  gzip -c /tmp/small_m_trace.csv > "$out/ncu_trace.csv.gz"
fi
tail -n 3 "$out/torch.log" "$out/mlx.log" "$out/ncu.log"
python3 - "$out/ncu_summary.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"].split()[0], r["M"], r["path"], r["us"], r["tb_s"], r["registers"], round(r["warps_active_pct"]), sep="\t")
PY
fi
# A whole decode step and verify-16 of the Qwen3.5-9B shape: wall time, then kernel-only time by kind.
for graphs in 0 1; do
  MLX_USE_CUDA_GRAPHS=$graphs python3 benchmarks/gpu_forward_kernels.py > "$out/forward_wall_graphs$graphs.jsonl" 2>> "$out/forward.log"
done
if [ -n "$NCU" ]; then
  MLX_USE_CUDA_GRAPHS=0 timeout 420 "$NCU" --clock-control none -f -o /tmp/forward_trace --metrics gpu__time_duration.sum,launch__grid_size \
    python3 benchmarks/gpu_forward_kernels.py --ncu > "$out/forward_configs.jsonl" 2>> "$out/forward.log" || echo "forward ncu failed"
  "$NCU" --import /tmp/forward_trace.ncu-rep --csv --page raw > /tmp/forward_trace.csv 2>> "$out/forward.log"
  python3 benchmarks/parse_ncu.py --trace /tmp/forward_trace.csv --configs "$out/forward_configs.jsonl" \
    --out "$out/forward_kernels.json" 2>> "$out/forward.log"
fi
cat "$out"/forward_wall_graphs*.jsonl
