"""Run a model's forwards once before it serves.

On CUDA, MLX compiles each variant of our kernels the first time a process meets it (NVRTC, about
2 s a variant on an H100: a fresh machine's first generation took 79 s where a warm one takes 1.7,
docs/performance.md). Without a warm-up those seconds land in the first requests, and in the
times `speculation: auto` takes of them. `warm_up` meets the variants a server's decoding meets:
contexts shorter and longer than one chunk of the attention kernel's keys, plain steps, every
width `auto` verifies (each twice, so that a cycle after a cycle runs too), the drafter's context
written after 1 to 33 plain steps (one of each row variant of the small-M product, and one past
it), the target alone, a batch of rows, and steps and cycles with log-probabilities and with a
grammar. Prefill shapes follow the prompts, which no warm-up
can know. It runs on an engine of its own over the same weights, so the model's prefix cache and
what `auto` measured are untouched; its tokens are thrown away.
"""

from __future__ import annotations

import time
from typing import Optional

from .batching import generate_together
from .engine import Engine
from .grammar import GrammarSpec, compile_grammar
from .speculation import auto_widths

# Prompt lengths: a context within one chunk of keys of the exact attention kernel (128), and past it.
PROMPT_LENGTHS = (16, 300)
# Plain steps before a full-width cycle: one catch-up of each row variant of the small-M product
# (up to 8, 16, 24 and 32 rows) and one that goes to cuBLASLt.
CATCH_UPS = (1, 9, 17, 25, 33)


class FixedPlans:
    """A SpeculationPolicy following a list of plans (0: a plain step, w: a cycle of width w),
    then plain steps."""

    name = "warm-up"
    speculating = True  # cycles draft ahead as a server's do (the drafts dropped where the next plan differs)

    def __init__(self, plans: list[int]):
        self.plans, self.next = plans, 0

    def plan(self, context: int) -> int:
        width = self.plans[self.next] if self.next < len(self.plans) else 0
        self.next += 1
        return width

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        pass

    def note(self) -> Optional[str]:
        return None


def warm_up_plans(block_size: int) -> list[int]:
    """Every width `auto` uses (`speculation.auto_widths`), twice in a row, then a full-width cycle
    after each of `CATCH_UPS` plain steps."""
    plans: list[int] = []
    for width in auto_widths(block_size):
        plans += [width, width]
    for steps in CATCH_UPS:
        plans += [0] * steps + [block_size]
    return plans


def most_tokens(plans: list[int]) -> int:
    """The most tokens `plans` can make: a cycle of width w at most w, a plain step one."""
    return sum(w or 1 for w in plans)


def warm_up(engine: Engine, rows: int = 4) -> Optional[float]:
    """Run `engine`'s forwards as described above; returns the seconds it took (None: the model's
    context is too short for even the short prompt)."""
    started = time.perf_counter()
    scratch = Engine(engine.target, engine.tokenizer, engine.drafter, prefill_chunk=engine.prefill_chunk,
                     max_context=engine.max_context)
    vocab = engine.target.vocab_size
    limit = engine.max_context or 1 << 30
    plans = warm_up_plans(engine.drafter.block_size) if engine.drafter is not None else []
    while plans and most_tokens(plans) + 2 + PROMPT_LENGTHS[0] > limit:
        plans.pop()  # a short context: fewer of the plans
    budget = max(most_tokens(plans) + 2, 8)  # (8: the target alone's and the batch's tokens)
    ran = False
    for which, length in enumerate(PROMPT_LENGTHS):
        length = min(length, limit - budget)
        if length < 1:
            continue
        ran = True
        prompt = [(7 * i + 1) % vocab for i in range(length)]
        common = {"prompt_tokens": prompt, "stop_token_ids": set()}
        for _ in scratch.generate(**common, max_tokens=4, speculative=False):
            pass
        if plans:
            policy = FixedPlans(plans)
            stream = scratch.generate(**common, max_tokens=budget, speculation=policy)
            for _ in stream:
                if policy.next > len(plans):  # every plan ran (the rest would be plain steps)
                    break
            stream.close()
        # A batch: the rows' products stacked (more rows than one generation's block), drafting
        # and verifying together where there is a drafter.
        requests = [{**common, "max_tokens": 8, **({"speculation": FixedPlans([engine.drafter.block_size] * 8)}
                                                  if engine.drafter is not None else {"speculative": False})}
                    for _ in range(rows)]
        generate_together(scratch, requests, max_rows=rows)
        if which == 0:
            _warm_up_requests(engine, scratch, common)
    return time.perf_counter() - started if ran else None


def _warm_up_requests(engine: Engine, scratch: Engine, common: dict) -> None:
    """What some requests add to a step, each once, plain steps and cycles alike: log-probabilities
    (a log-softmax and a top-k over the vocabulary) and a grammar's token masks. The grammar's view
    of the vocabulary is built on the model's own engine, where requests find it (it takes seconds
    for a large vocabulary); a tokenizer that grammars cannot use skips that part, as its requests
    would be refused anyway."""
    mixed = [engine.drafter.block_size, 0, 0, 2] if engine.drafter is not None else []
    variants: list[dict] = [{"logprobs": 5}]
    try:
        spec = GrammarSpec("regex", "[a-z ]{64}")  # (a fixed length: it ends at its end, not after a token)
        variants.append({"grammar": compile_grammar(spec, engine.grammar_tokenizer)})
    except Exception:  # noqa: BLE001 - no grammars for this tokenizer (a random model's, say)
        pass
    for extra in variants:
        for _ in scratch.generate(**common, max_tokens=4, speculative=False, **extra):
            pass
        if mixed:
            for _ in scratch.generate(**common, max_tokens=most_tokens(mixed) + 1, speculation=FixedPlans(mixed), **extra):
                pass
