"""One rank of the two-process engine test (tests/test_distributed.py): every rank loads each tiny
pair sharded over the group and runs the same generations in lockstep; rank 0 writes what came out.

    python tests/distributed_rank.py OUT.json FAMILY=TARGET_DIR,DRAFTER_DIR ...

A FAMILY ending in ":stacked" (qwen3_5:stacked=...) runs that pair with the CUDA path's stacked
projections on, and only the generations tests/test_distributed.py checks for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forced import ForcedDrafter  # noqa: E402

from dflash_core.distributed import Channel, LockstepEngine, init_group  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.loading import load_engine, parameter_bytes  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402

PROMPT = list(range(5, 45))
N_TOKENS = 144  # every acceptance length once (1 + 136 tokens), a few more; contexts far past the windows (8)
SCHEDULE = list(range(16))  # every acceptance length once: 136 tokens
# The other generations: still past the windows (the prompt alone is), a third of the time. The
# random drafter is accepted little, so each of its tokens costs a whole lockstep cycle.
SHORT = 48


def tokens(engine, n: int = SHORT, **kwargs) -> list[int]:
    return [t for c in engine.generate(PROMPT, max_tokens=n, stop_token_ids=set(), **kwargs) for t in c.token_ids]


def run(family: str, target: str, drafter: str, channel: Channel, stacked_only: bool = False) -> dict:
    engine = load_engine(target, drafter, prefill_chunk=16, group=channel.group)
    stacked = sum(g.stacked for groups in engine.target.shared_inputs for g in groups.values())
    lockstep = LockstepEngine(engine, channel)
    alone = tokens(lockstep, N_TOKENS, speculative=False)
    forced = ForcedDrafter(reference=PROMPT + alone + [0] * 16, prompt_length=len(PROMPT), schedule=SCHEDULE,
                           vocab_size=engine.target.vocab_size, target_layer_ids=engine.drafter.config.target_layer_ids)
    forced_engine = LockstepEngine(Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16), channel)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    if stacked_only:  # what the stacked-projections test checks
        return {"alone": alone, "every_acceptance_length": tokens(forced_engine, N_TOKENS, speculation="on"),
                "random_drafter_on": tokens(lockstep, speculation="on"), "stacked_groups": stacked}
    return {
        "alone": alone,
        "every_acceptance_length": tokens(forced_engine, N_TOKENS, speculation="on"),
        "random_drafter_on": tokens(lockstep, speculation="on"),
        "random_drafter_auto": tokens(lockstep, speculation="auto"),
        "seeded_alone": tokens(lockstep, speculative=False, sampling=seeded),
        "seeded_on": tokens(lockstep, speculation="on", sampling=seeded),
        # No seed given: rank 0 picks one for every rank; both runs must agree with each other.
        "unseeded": tokens(lockstep, speculation="auto", sampling=SamplingParams(temperature=0.9)),
        "target_bytes": parameter_bytes(engine.target.model),
        "stacked_groups": stacked,
    }


def main() -> None:
    from dflash_core.kernels import matmul

    out = Path(sys.argv[1])
    channel = Channel(init_group())
    results = {"size": channel.size}
    for spec in sys.argv[2:]:
        family, paths = spec.split("=", 1)
        target, drafter = paths.split(",")
        if family.endswith(":stacked"):
            # The CUDA path's stacked projections (kernels/matmul.py), here on the CPU, over the
            # slices each rank holds (as tests/test_lossless.py forces them in one process), for
            # this pair's load and generations only.
            backend, matmul.backend = matmul.backend, lambda: "cuda"
            try:
                results[family] = run(family, target, drafter, channel, stacked_only=True)
            finally:
                matmul.backend = backend
        else:
            results[family] = run(family, target, drafter, channel)
    # Every rank says what it saw: the ranks must agree token for token.
    Path(f"{out}.rank{channel.rank}").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
