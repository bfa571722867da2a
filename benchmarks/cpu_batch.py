"""Continuous batching on this machine: N streamed requests at once against the same N one after
another, through a real server, in one run.

    python benchmarks/cpu_batch.py --streams 1,2,4,8 --out cpu_batch.json

A tiny random Qwen3 target with an untrained drafter (the tests' fixtures, tests/synthetic.py) is
served by `dflash serve` (one process per speculation mode in --modes: `off`, the target alone;
`auto`, the default; `on`, DFlash at about one token per cycle); each request asks for
--max-tokens greedy tokens of a distinct prompt with EOS ignored. For each N: the wall time of N
requests one after another and of N requests sent together (medians of --repeats runs of each, in
turn), aggregate tok/s, per-stream tok/s and time to first token, the server process's CPU time
each way (all its threads: the engine, the event loop, MLX's and the BLAS's), and whether every
answer was the same both ways (batching must not change a token). The requests go through one
HTTP client with a pool of keep-alive connections, as an SDK client sends them
(`--connection-per-request`: a new client and connection for each, as this script did before
2026-12-04; on this 2-core box making an httpx client, its TLS context included, costs about 50 ms
of the client's CPU, which then counted in every request's time).

`--engine`: the same requests through the engine alone in this process (`Engine.generate` one after
another against `generate_together`), with the fast BLAS loaded first as `dflash` loads it: what
batching gives before the server and its clients share the cores with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from serving import start_server  # noqa: E402

EOS: list[int] = []  # the target's end-of-sequence ids, read from its generation_config.json


def start(target: Path, drafter: Path, speculation: str, workdir: Path):
    return start_server({
        "server": {"max_active": 16},
        "prefix_cache_gb": 0,  # every request computes its prompt: the same work both ways
        "models": [{"name": "bench", "target": str(target), "drafter": str(drafter), "speculation": speculation}],
    }, workdir, speculation, timeout=300)


def stream(client: Optional[httpx.Client], url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion through `client` (None: a client of its own, made and closed here)."""
    # End-of-sequence banned (logit_bias), so that every request generates exactly max_tokens.
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in EOS}, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text = None, []
    with (client.stream if client is not None else httpx.stream)("POST", url + "/v1/completions", json=body,
                                                                  timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                assert chunk["usage"]["completion_tokens"] == max_tokens, chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - start
                    text.append(choice["text"])
    return {"seconds": time.perf_counter() - start, "ttft": first, "text": "".join(text)}


def prompts(n: int) -> list[str]:
    return [f"Story {i}: the {['red', 'blue', 'green', 'old', 'new'][i % 5]} lighthouse number {i * 7 % 31} saw"
            for i in range(n)]


def _together(client: Optional[httpx.Client], url: str, texts: list[str], max_tokens: int) -> tuple[float, list]:
    results = [None] * len(texts)

    def run(i):
        results[i] = stream(client, url, texts[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, results


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, n: int, max_tokens: int, repeats: int = 3, pid: int = 0, pooled: bool = True) -> dict:
    """N requests one after another, then the same N at once, `repeats` times in turn: the median
    wall time of each way (this 2-core machine is noisy; one run of a second or less is not a figure),
    and the server's (process `pid`) median CPU time each way."""
    texts = prompts(n)
    client = httpx.Client(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) if pooled else None
    stream(client, url, texts[0], 8)  # warm-up: compiled blocks for these shapes
    if client is not None:  # and every connection the concurrent requests will use
        _together(client, url, texts, 1)
    walls_alone, walls_together, cpu_alone, cpu_together = [], [], [], []
    try:
        for _ in range(repeats):
            start, cpu = time.perf_counter(), cpu_seconds(pid)
            alone = [stream(client, url, t, max_tokens) for t in texts]
            walls_alone.append(time.perf_counter() - start)
            cpu_alone.append(cpu_seconds(pid) - cpu)
            cpu = cpu_seconds(pid)
            wall, together = _together(client, url, texts, max_tokens)
            walls_together.append(wall)
            cpu_together.append(cpu_seconds(pid) - cpu)
            if [a["text"] for a in alone] != [b["text"] for b in together]:
                break
    finally:
        if client is not None:
            client.close()
    one_by_one, at_once = statistics.median(walls_alone), statistics.median(walls_together)
    tokens = n * max_tokens
    return {
        "streams": n, "repeats": len(walls_alone), "pooled_connections": pooled,
        "one_by_one_s": one_by_one, "together_s": at_once,
        "one_by_one_s_all": walls_alone, "together_s_all": walls_together, "speedup": one_by_one / at_once,
        "server_cpu_s_one_by_one": statistics.median(cpu_alone), "server_cpu_s_together": statistics.median(cpu_together),
        "aggregate_tok_s": tokens / at_once, "aggregate_tok_s_one_by_one": tokens / one_by_one,
        "per_stream_tok_s": sum(max_tokens / r["seconds"] for r in together) / n,
        "solo_stream_tok_s": sum(max_tokens / r["seconds"] for r in alone) / n,
        "ttft_s_together": sum(r["ttft"] for r in together) / n,
        "same_output": [a["text"] for a in alone] == [b["text"] for b in together],
    }


def measure_engine(engine, mode: str, n: int, max_tokens: int, repeats: int = 3) -> dict:
    """`measure` without the server: N generations one after another and together, in turn."""
    from dflash_core.batching import generate_together

    prompts_ids = [engine.tokenizer.encode(t) for t in prompts(n)]
    requests = [{"prompt_tokens": p, "max_tokens": max_tokens, "stop_token_ids": set(), "speculation": mode}
                for p in prompts_ids]  # no stop token: exactly max_tokens each, as the server runs ban EOS

    def alone() -> list:
        return [[t for c in engine.generate(**r) for t in c.token_ids] for r in requests]

    def together() -> list:
        return [[t for c in chunks for t in c.token_ids] for chunks in generate_together(engine, requests, max_rows=n)]

    alone(), together()  # warm-up: compiled blocks for these shapes
    walls_alone, walls_together, same = [], [], True
    for _ in range(repeats):
        start = time.perf_counter()
        a = alone()
        walls_alone.append(time.perf_counter() - start)
        start = time.perf_counter()
        b = together()
        walls_together.append(time.perf_counter() - start)
        same = same and a == b
    one_by_one, at_once = statistics.median(walls_alone), statistics.median(walls_together)
    return {"streams": n, "repeats": repeats, "one_by_one_s": one_by_one, "together_s": at_once,
            "one_by_one_s_all": walls_alone, "together_s_all": walls_together, "speedup": one_by_one / at_once,
            "aggregate_tok_s": n * max_tokens / at_once, "same_output": same}


def engine_rows(args, target: Path, drafter: Path, work: Path) -> list[dict]:
    """--engine: each mode and stream count through the engine alone, in this process."""
    from dflash_core.loading import load_engine

    engine = load_engine(str(target), str(drafter))
    rows = []
    for mode in args.modes.split(","):
        for n in args.streams:
            row = {"speculation": mode, "engine_alone": True,
                   **measure_engine(engine, mode, n, args.max_tokens, args.repeats)}
            rows.append(row)
            print(f"{mode:>4} {n:>3} streams, engine alone | one by one {row['one_by_one_s']:6.2f} s, together "
                  f"{row['together_s']:6.2f} s: {row['speedup']:.2f}x | same output: {row['same_output']}", flush=True)
    return rows


def server_rows(args, target: Path, drafter: Path, work: Path) -> list[dict]:
    """Each mode through a server of its own, each stream count against it."""
    rows = []
    for mode in args.modes.split(","):
        process, url = start(target, drafter, mode, work)
        try:
            for n in args.streams:
                row = {"speculation": mode, **measure(url, n, args.max_tokens, args.repeats, process.pid,
                                                         pooled=not args.connection_per_request)}
                rows.append(row)
                print(f"{mode:>4} {n:>3} streams | one by one {row['one_by_one_s']:6.2f} s, together "
                      f"{row['together_s']:6.2f} s: {row['speedup']:.2f}x | aggregate {row['aggregate_tok_s']:7.1f} "
                      f"tok/s, per stream {row['per_stream_tok_s']:6.1f} (alone {row['solo_stream_tok_s']:6.1f}) "
                      f"| server CPU s {row['server_cpu_s_one_by_one']:.2f} / {row['server_cpu_s_together']:.2f} "
                      f"| same output: {row['same_output']}", flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--repeats", type=int, default=3, help="each N's two ways, this many times in turn (medians)")
    parser.add_argument("--connection-per-request", action="store_true",
                        help="a new HTTP client and connection for every request (see above)")
    parser.add_argument("--engine", action="store_true", help="the engine alone, no server (see above)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.engine:
        sys.path.insert(0, str(ROOT))
        from dflash_core.blas import preload

        preload()  # before anything imports MLX, as `dflash` does
    sys.path.insert(0, str(ROOT / "tests"))
    from synthetic import tiny_pair  # the tests' fixtures: a tiny checkpoint on disk, with a tokenizer

    report = {"machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "max_tokens": args.max_tokens,
              "command": "python benchmarks/cpu_batch.py " + " ".join(sys.argv[1:]), "rows": []}
    with tempfile.TemporaryDirectory() as work:
        target, drafter = tiny_pair(Path(work) / "tiny", "qwen3")
        eos = json.loads((target / "generation_config.json").read_text())["eos_token_id"]
        EOS.extend(eos if isinstance(eos, list) else [eos])
        report["rows"] = (engine_rows if args.engine else server_rows)(args, target, drafter, Path(work))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
