"""Time to first token per turn of a scripted agent conversation, with and without the prefix cache.

An agent loop resends the whole conversation every turn: a system prompt with tool definitions, the
user's task, the model's answers and long tool results, growing to about 4k tokens over 10 turns.
Both runs go through the real HTTP server (`dflash serve` in a subprocess) with greedy decoding, so
they see identical conversations; only `prefix_cache_gb` differs.

    python benchmarks/agent_prefix_cache.py --synthetic            # random-weight model, any machine
    python benchmarks/agent_prefix_cache.py --target T --drafter D # a real model
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import start_server  # noqa: E402

SYSTEM = (
    "You are a coding agent working in a repository. Think briefly, then either call a tool or answer. "
    "Keep answers short. Tools return long outputs; read them carefully."
)
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from the repository",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite and return its log",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def tool_output(turn: int) -> str:
    """A deterministic, log-like tool result of a few hundred tokens."""
    lines = [f"tests/test_module_{turn}.py::test_case_{i} {'PASSED' if (i * 7 + turn) % 5 else 'FAILED'} "
             f"[{(i * 13) % 100:3d}%] duration {(i * 37 + turn) % 97 / 10:.1f}s" for i in range(10)]
    return "\n".join(lines)


def start(target: str, drafter: str, cache_gb: float, workdir: Path):
    return start_server({
        "prefix_cache_gb": cache_gb,
        "models": [{"name": "bench", "target": target, "drafter": drafter, "max_context": 32768,
                    "chat_template_kwargs": {"enable_thinking": False}}],
    }, workdir, str(cache_gb))


def chat_stream(client: httpx.Client, url: str, messages, max_tokens: int):
    """(time to first token, answer text, usage) of one streamed request, on `client`'s kept
    connection as an SDK sends it (making a client costs tens of ms, which a TTFT would count)."""
    body = {"model": "bench", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                piece = delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                if piece and first is None:
                    first = time.perf_counter() - start
                if delta.get("content"):
                    text.append(delta["content"])
    return first if first is not None else time.perf_counter() - start, "".join(text), usage


def conversation(url: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "The test suite fails. Find out why and fix it."}]
    rows = []
    with httpx.Client() as client:
        for turn in range(turns):
            ttft, text, usage = chat_stream(client, url, messages, max_tokens)
            rows.append({"turn": turn + 1, "prompt_tokens": usage["prompt_tokens"],
                         "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "ttft_s": ttft})
            messages += [{"role": "assistant", "content": text or "Let me look."},
                         {"role": "user", "content": f"Tool output:\n{tool_output(turn)}\nWhat next?"}]
    return rows


def synthetic_model(workdir: Path, family: str, shape: dict) -> tuple[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import tiny_pair  # the tests' fixtures: a tiny checkpoint on disk, with a tokenizer

    target, drafter = tiny_pair(workdir / "model", family, target_kwargs={"shape": shape})
    return str(target), str(drafter)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--synthetic", action="store_true", help="a random-weight model (no download)")
    parser.add_argument("--family", default="qwen3_5", help="with --synthetic: qwen3, qwen3_5, qwen3_5_moe, gemma4")
    parser.add_argument("--hidden-size", type=int, default=256, help="with --synthetic")
    parser.add_argument("--layers", type=int, default=4, help="with --synthetic")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-agent-bench-"))
    if args.synthetic:
        shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers, "intermediate_size": 3 * args.hidden_size,
                 "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": args.hidden_size // 8}
        target, drafter = synthetic_model(workdir, args.family, shape)
    elif args.target:
        target, drafter = args.target, args.drafter or "auto"
    else:
        parser.error("pass --synthetic or --target")
    results = {}
    for label, cache_gb in (("without cache", 0.0), ("with cache", 2.0)):
        process, url = start(target, drafter, cache_gb, workdir)
        try:
            results[label] = conversation(url, args.turns, args.max_tokens)
        finally:
            process.terminate()
            process.wait(timeout=30)
    off, on = results["without cache"], results["with cache"]
    print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'TTFT off (s)':>13} {'TTFT on (s)':>12} {'speedup':>8}")
    for a, b in zip(off, on):
        print(f"{a['turn']:>4} {a['prompt_tokens']:>10} {b['cached_tokens']:>10} {a['ttft_s']:>13.3f} "
              f"{b['ttft_s']:>12.3f} {a['ttft_s'] / b['ttft_s']:>7.1f}x")
    total_off, total_on = sum(r["ttft_s"] for r in off), sum(r["ttft_s"] for r in on)
    print(f"total TTFT: {total_off:.2f} s without, {total_on:.2f} s with the cache ({total_off / total_on:.1f}x)")
    if args.out:
        args.out.write_text(json.dumps({"target": target, "drafter": drafter, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
