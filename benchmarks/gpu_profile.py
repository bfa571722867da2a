"""Where the time of a decode step and of a DFlash cycle goes, phase by phase (diagnostics).

Each phase is timed on its own, synchronised, per iteration (medians): host graph building versus
device time, compiled per-layer blocks versus eager ops, and effects that depend on shapes that
change every cycle (attention over a growing cache, GatedDeltaNet replays of varying length).

    python benchmarks/gpu_profile.py --model qwen3.5-9b --contexts 1024,8192

`--launches` instead compares a decode step and a verify forward whose projections that share an
input go through one 4-bit kernel launch or one bf16 GEMM (weights stacked at load) against one
per weight, the two interleaved in one process (this machine's noise moves a whole run by more
than the difference). `--attention` compares, the same way, verify attention through the block
attention path (dflash_core/kernels/attention.py) against MLX's fused attention.

    python benchmarks/gpu_profile.py --model qwen3.5-9b --quant 4bit --contexts 1024,8192 --launches
    python benchmarks/gpu_profile.py --model qwen3.5-9b --quant bf16 --contexts 1024,32768 --attention
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_cycle import build_drafter, build_target  # noqa: E402
from gpu_cycle import per_iteration_ms as per_iteration  # noqa: E402

from dflash_core.engine import Engine  # noqa: E402
from dflash_core.kernels import KernelOptions  # noqa: E402
from dflash_core.kernels import gated_delta as gd  # noqa: E402
from dflash_core.prefix_cache import PrefixCache  # noqa: E402
from dflash_core.random_models import ByteTokenizer  # noqa: E402


def build_only(fn, iters=8) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        mx.eval(out)
    return statistics.median(times[2:]) * 1e3


def medians(out: dict) -> dict:
    """Each repeated measurement (a list) as its median; other entries as they are."""
    return {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in out.items()}


def prefilled(adapter, drafter, context: int):
    """The prefix-cache snapshot after prefilling `context` random tokens (with the drafter's
    context when there is a drafter): each measurement restores it. Prefilled in the server's
    2048-token chunks: Gemma-4-31B's 4096-token chunks run out of memory at 32K (performance.md)."""
    tokenizer = ByteTokenizer(adapter.vocab_size)
    engine = Engine(adapter, tokenizer, drafter, prefill_chunk=2048, prefix_cache=PrefixCache(16 << 30))
    prompt = mx.random.randint(0, adapter.vocab_size, (context,)).tolist()
    list(engine.generate(prompt, max_tokens=2, stop_token_ids=set()))
    return engine.prefix_cache.lookup(prompt, need_context=drafter is not None)


def profile(name: str, quant: str, context: int, layers=None, tiny=False) -> dict:
    adapter = build_target(name, quant, layers, tiny)
    drafter = build_drafter(name, adapter, tiny)
    snapshot = prefilled(adapter, drafter, context)
    taps = drafter.config.target_layer_ids
    one = mx.array([[7]])
    block = mx.random.randint(0, adapter.vocab_size, (1, 16))
    out = {"model": name, "quant": quant, "context": context}
    for mode, limit in (("eager", 0), ("compiled", 16), ("eager", 0), ("compiled", 16)):
        adapter.compile_max_tokens = limit
        cache, _ = snapshot.restore()
        decode = per_iteration(lambda: [adapter.forward(one, cache).logits])
        decode_build = build_only(lambda: [adapter.forward(one, cache).logits])
        cache, _ = snapshot.restore()

        def verify_full():
            v = adapter.forward(block, cache, taps, record=True)
            adapter.rollback(cache, v.rollback, keep=16)
            return [v.logits, v.tapped_hidden]

        verify = per_iteration(verify_full)
        verify_build = build_only(lambda: [adapter.forward(block, cache, taps, record=True).logits])
        for key, value in (("decode_ms", decode), ("decode_build_ms", decode_build), ("verify_ms", verify),
                           ("verify_build_ms", verify_build)):
            out.setdefault(f"{mode}_{key}", []).append(value)

    # Verify + rollback to alternating lengths (a cycle keeps 6, then 7, ...), to 7, and to all 16.
    # The rollback either replays the recurrence from its inputs or (CUDA) picks a state the verify
    # recorded; the default, which replays the deltas a verify recorded, is `..._deltas`.
    adapter.compile_max_tokens = 16

    def verify_and_rollback():
        v = target.forward(block, cache, taps, record=True)
        target.rollback(cache, v.rollback, keep=next(keeps))
        return [v.logits] + [a for c in cache if hasattr(c, "cache") for a in c.cache]

    arms = {"replay": KernelOptions(step_states=False), "step_states": KernelOptions(step_deltas=False),
            "deltas": KernelOptions()}
    for label in ("replay", "step_states", "deltas", "replay", "step_states", "deltas"):
        target = adapter.with_kernels(arms[label])
        for keep_label, pattern in (("6_7", [6, 7]), ("7", [7]), ("16", [16])):
            keeps = iter(pattern * 40)
            cache, context_cache = snapshot.restore()
            out.setdefault(f"verify_rollback_{keep_label}_{label}_ms", []).append(per_iteration(verify_and_rollback))

    def draft():
        drafter.add_context(mx.zeros((1, 1, len(taps) * adapter.hidden_size), adapter.dtype), context_cache)
        return [drafter.propose(mx.array([3]), adapter, context_cache)]

    out["draft_ms"] = per_iteration(draft)
    out["draft_build_ms"] = build_only(draft)

    # Attention of 16 queries over a cache that grows each call, against a fixed length.
    heads, kv_heads, dim = 16, 4, 256
    q = mx.random.normal((1, heads, 16, dim)).astype(mx.bfloat16)
    keys = mx.random.normal((1, kv_heads, context + 400, dim)).astype(mx.bfloat16)
    lengths = iter(range(context, context + 400, 16))
    out["sdpa16_growing_ms"] = per_iteration(lambda: [mx.fast.scaled_dot_product_attention(
        q, keys[:, :, : (n := next(lengths))], keys[:, :, :n], scale=dim**-0.5, mask="causal")], iters=10)
    out["sdpa16_fixed_ms"] = per_iteration(lambda: [mx.fast.scaled_dot_product_attention(
        q, keys[:, :, :context], keys[:, :, :context], scale=dim**-0.5, mask="causal")], iters=10)

    # The recurrence alone for replays of alternating lengths.
    B, Hk, Hv, Dk, Dv = 1, 16, 32, 128, 128
    qq = mx.random.normal((B, 16, Hk, Dk)).astype(mx.bfloat16) * 0.1
    vv = mx.random.normal((B, 16, Hv, Dv)).astype(mx.bfloat16)
    g = mx.full((B, 16, Hv), 0.9)
    beta = mx.full((B, 16, Hv), 0.5).astype(mx.bfloat16)
    state = mx.zeros((B, Hv, Dv, Dk))
    t_iter = iter([6, 7] * 20)

    def replay():
        t = next(t_iter)
        return list(gd.gated_delta(qq[:, :t], qq[:, :t], vv[:, :t], g[:, :t], beta[:, :t], state))

    out["gdn_replay_6_7_ms"] = per_iteration(replay)
    return medians(out)


# What an A/B turns on and off: the KernelOptions field, and the labels of its two arms.
SWITCHES = {
    "launches": ("one_launch_per_input", "fused", "apart"),  # one launch per shared input or per weight
    "attention": ("block_attention", "block", "mlx"),  # block attention or MLX's fused
}


def alternate(switch: str, name: str, quant: str, context: int, rounds: int = 6, layers=None, tiny=False) -> dict:
    """Decode and verify-16 ms (medians over `rounds` alternations) with a switch of SWITCHES on
    and off."""
    option, on_label, off_label = SWITCHES[switch]
    adapter = build_target(name, quant, layers, tiny)
    snapshot = prefilled(adapter, None, context)
    one, block = mx.array([[7]]), mx.random.randint(0, adapter.vocab_size, (1, 16))
    out = {"model": name, "quant": quant, "context": context, "rounds": rounds}
    for _ in range(rounds):
        for label, on in ((on_label, True), (off_label, False)):
            target = adapter.with_kernels(KernelOptions(**{option: on}))  # blocks traced once per arm
            cache, _ = snapshot.restore()
            out.setdefault(f"{label}_decode_ms", []).append(per_iteration(lambda: [target.forward(one, cache).logits]))
            cache, _ = snapshot.restore()

            def verify():
                # A full acceptance keeps all 16 (the rollback has nothing to undo), so each of the
                # 13 timed and warm-up forwards adds 16 tokens: the context ends about 200 past the
                # snapshot's, the same in both arms.
                v = target.forward(block, cache, record=True)
                target.rollback(cache, v.rollback, keep=16)
                return [v.logits]

            out.setdefault(f"{label}_verify16_ms", []).append(per_iteration(verify))
    return medians(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3.5-9b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--tiny", action="store_true")
    ab = parser.add_mutually_exclusive_group()
    ab.add_argument("--launches", action="store_true", help="one launch per shared input against one per weight")
    ab.add_argument("--attention", action="store_true", help="block attention against MLX's fused attention")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        if args.launches or args.attention:
            row = alternate("launches" if args.launches else "attention", args.model, args.quant, context, tiny=args.tiny)
        else:
            row = profile(args.model, args.quant, context, tiny=args.tiny)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
