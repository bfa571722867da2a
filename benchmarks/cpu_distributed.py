"""One process against a target sharded over two local ranks (MLX's ring backend over 127.0.0.1).

    python benchmarks/cpu_distributed.py --tokens 64 --repeats 2 --out docs/cpu/cpu_distributed.json

A random Qwen3 target (float32, --hidden/--layers/--intermediate; the same seeded weights in every
process) decodes --tokens greedy tokens after a --prompt-token prompt, the target alone and with a
random drafter (`speculation: on`), once in one process and once over two ranks
(`dflash_core.distributed`: each rank holds half of every projection, the layers all-reduce), the
runs alternating --repeats times. Reported: decode tok/s of each, their ratio, each rank's weight
bytes, and whether both gave the same tokens. On one machine two ranks share its cores and add an
all-reduce per layer, so they are not expected to be faster: this measures the cost of sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shape(args) -> dict:
    return {"base": "tiny", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "intermediate_size": args.intermediate, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": args.hidden // 16, "vocab_size": args.vocab}


def run_rank(args) -> None:
    """One process's runs (with MLX_HOSTFILE and MLX_RANK: one rank of two)."""
    import mlx.core as mx

    from dflash_core.adapters import adapter_for
    from dflash_core.distributed import Channel, LockstepEngine, init_group
    from dflash_core.engine import Engine
    from dflash_core.loading import parameter_bytes
    from dflash_core.random_models import ByteTokenizer, random_drafter
    from dflash_core.shapes import random_model, target_config
    from dflash_core.sharding import shard_target

    channel = Channel(init_group()) if "MLX_RANK" in os.environ else None
    model = random_model(target_config("qwen3", shape(args)), seed=0)
    mx.eval(model.parameters())
    if channel is not None:
        shard_target(model, channel.group)
    target = adapter_for(model)
    mx.random.seed(1)  # the drafter's random weights: the same in every process
    drafter = random_drafter("qwen3-8b", target, tiny=True)
    tokenizer = ByteTokenizer(target.vocab_size)
    prompt = list(range(3, 3 + args.prompt_tokens))
    result = {"target_bytes": parameter_bytes(model), "ranks": channel.size if channel else 1}
    for mode in ("alone", "dflash"):
        engine = Engine(target, tokenizer, drafter if mode == "dflash" else None, prefill_chunk=256)
        if channel is not None:
            engine = LockstepEngine(engine, channel)
        extra = {"speculation": "on"} if mode == "dflash" else {"speculative": False}
        list(engine.generate(prompt, max_tokens=4, stop_token_ids=set(), **extra))  # traces the shapes
        tokens, last = [], None
        for chunk in engine.generate(prompt, max_tokens=args.tokens, stop_token_ids=set(), **extra):
            tokens += chunk.token_ids
            last = chunk
        result[mode] = {"tok_s": last.stats.decode_tokens_per_second, "tokens": tokens}
    if channel is None or channel.leader:
        print(json.dumps(result), flush=True)


def _two_ranks(args) -> dict:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = Path(f"/tmp/dflash-bench-hosts-{os.getpid()}.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    command = [sys.executable, __file__, "--rank-run", *_forwarded(args)]
    procs = [subprocess.Popen(command, env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    hostfile.unlink()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def _one_process(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    out = subprocess.run([sys.executable, __file__, "--rank-run", *_forwarded(args)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def _forwarded(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("rank_run", "out", "repeats") and v is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        return run_rank(args)
    runs = {"one process": [], "two ranks": []}
    for _ in range(args.repeats):  # alternating, so that the machine's drift hits both alike
        runs["one process"].append(_one_process(args))
        runs["two ranks"].append(_two_ranks(args))
    report = {"date": time.strftime("%Y-%m-%d"), "shape": shape(args), "prompt_tokens": args.prompt_tokens,
              "tokens": args.tokens, "cpu_count": os.cpu_count(), "rows": []}
    for mode in ("alone", "dflash"):
        one = statistics.median(r[mode]["tok_s"] for r in runs["one process"])
        two = statistics.median(r[mode]["tok_s"] for r in runs["two ranks"])
        same = all(a[mode]["tokens"] == b[mode]["tokens"] for a, b in zip(runs["one process"], runs["two ranks"]))
        report["rows"].append({"mode": mode, "one_process_tok_s": one, "two_ranks_tok_s": two,
                               "ratio": two / one, "same_tokens": same})
        print(f"{mode:>6}: one process {one:7.1f} tok/s | two ranks {two:7.1f} tok/s | {two / one:.2f}x | "
              f"same tokens: {same}", flush=True)
    report["target_bytes"] = {"one process": runs["one process"][0]["target_bytes"],
                              "each of two ranks": runs["two ranks"][0]["target_bytes"]}
    print(f"target weights: {report['target_bytes']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
