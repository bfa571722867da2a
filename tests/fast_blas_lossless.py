"""The lossless checks in a process whose float32 products go to the fast BLAS (MKL), as `dflash
serve` runs on Linux (tests/test_blas.py runs this). The rest of the suite runs on MLX's reference
BLAS, which rounds a row the same whatever the other rows; a fast BLAS picks its kernels by the
matrices' shapes, so here whatever a verify and a decode step compute with different row counts
must be our fixed-order kernels (cpu_linear.cpp, cpu_attention.cpp, cpu_head.py) for the output to
stay the target's.

    python tests/fast_blas_lossless.py OUT.json FAMILY=TARGET_DIR,DRAFTER_DIR ...

Per family: a 16-token verify against 16 single steps (to the bit), the drafter's context of 16
taps added at once against one at a time (to the bit), then speculative output against
target-alone output, greedy with the random drafter and with every acceptance length 0..15 forced,
and with seeded sampling. OUT.json gets the BLAS that ran and each check's result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload, provider  # noqa: E402

LOADED = preload()  # before anything imports MLX, as `dflash` does

import numpy as np  # noqa: E402
from families import sample_prompt  # noqa: E402
from forced import ForcedDrafter, context_difference, verify_and_steps  # noqa: E402

from dflash_core.engine import Engine  # noqa: E402
from dflash_core.loading import load_engine  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402

N_TOKENS = 144  # 1 + 136 tokens take every acceptance length once; contexts past the windows
SCHEDULE = list(range(16))


def tokens_of(engine: Engine, prompt: list[int], **kwargs) -> list[int]:
    chunks = engine.generate(prompt, max_tokens=N_TOKENS, stop_token_ids=set(), **kwargs)
    return [t for c in chunks for t in c.token_ids]


def check(target_dir: str, drafter_dir: str) -> dict:
    engine = load_engine(target_dir, drafter_dir, prefill_chunk=16)
    # As loaded: the tiny model's layers and head are below the narrow copies' sizes, so each goes
    # through the primitive's float32 product (cpu_linear.fixed_order_weight), as a real model's
    # routers and gates do.
    assert engine.target.narrow_linears == 0
    prompt = sample_prompt(engine)
    verify, steps = verify_and_steps(engine.target, (prompt * 8)[:100], prompt[:16])
    result = {"verify_difference": float(np.abs(verify - steps).max()),
              "context_difference": context_difference(engine.drafter)}
    reference = tokens_of(engine, prompt, speculative=False)
    result["random_drafter"] = tokens_of(engine, prompt) == reference
    forced = ForcedDrafter(reference=prompt + reference, prompt_length=len(prompt), schedule=SCHEDULE,
                           vocab_size=engine.target.vocab_size,
                           target_layer_ids=engine.drafter.config.target_layer_ids)
    result["every_acceptance_length"] = tokens_of(Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16),
                                                  prompt) == reference
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    result["seeded_sampling"] = (tokens_of(engine, prompt, sampling=sampling)
                                 == tokens_of(engine, prompt, sampling=sampling, speculative=False))
    return result


def main() -> None:
    out = {"loaded": LOADED, "provider": provider(), "families": {}}
    for spec in sys.argv[2:]:
        family, dirs = spec.split("=", 1)
        out["families"][family] = check(*dirs.split(","))
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
