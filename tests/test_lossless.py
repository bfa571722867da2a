"""Speculative output equals target-alone output token for token, for every family.

Random drafters accept almost nothing, so each family is also driven by a forced drafter that
proposes the target's own continuation with an error planted so that every acceptance length
0..15 occurs, including full acceptance. Gemma 4's fixture has a sliding window of 8, far below
the contexts reached here.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt
from forced import ForcedDrafter

from dflash_core.engine import Engine, RequestError
from dflash_core.kernels import attention as block_attention
from dflash_core.kernels import matmul as small_m
from dflash_core.loading import load_engine

FAMILIES = ENGINE_FAMILIES
N_TOKENS = 256


def _run(engine: Engine, prompt, max_tokens=N_TOKENS, **kwargs):
    chunks = list(engine.generate(prompt, max_tokens=max_tokens, stop_token_ids=set(), **kwargs))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


@pytest.fixture(scope="module")
def references(engines):
    out = {}
    for family, engine in engines.items():
        prompt = _prompt(engine)
        # A block longer than needed, so forced drafts never run past the known continuation.
        tokens, last = _run(engine, prompt, max_tokens=N_TOKENS + 16, speculative=False)
        assert len(tokens) == N_TOKENS + 16 and last.finish_reason == "length"
        assert not last.stats.speculative
        out[family] = (prompt, tokens)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_is_lossless(engines, references, family):
    prompt, reference = references[family]
    tokens, last = _run(engines[family], prompt)
    assert last.stats.speculative and last.stats.cycles > 0
    assert tokens == reference[:N_TOKENS]


# Every acceptance length 0..15, in an order that also puts short and long ones side by side.
SCHEDULE = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8, 15, 15, 0, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_acceptance_length_is_lossless(engines, references, family):
    _check_every_acceptance_length(engines, references, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_acceptance_length_drafting_after_the_read_is_lossless(engines, references, family):
    """The same with each cycle's drafts made after the host read the cycle before (as rows
    batched with others, and generations under a grammar, still draft)."""
    _check_every_acceptance_length(engines, references, family, drafts_ahead=False)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4", "gemma3"])
def test_cuda_attention_paths_are_lossless(engines, references, family, monkeypatch, exact_attention_calls):
    """The attention paths CUDA takes, run here on the CPU: the target's decode steps and verify
    blocks through the exact kernel's gate (kernels/attention_cuda.py; its CPU stand-in here), and
    the drafter's blocks too (`drafter_exact_attention`: context and block joined into one key
    segment), none through the stacked GEMMs (kernels/attention.py). The dense, Qwen3.5, Gemma 4
    (sliding and global layers, shared K/V) and Gemma 3 (rings) adapters all hand their masks and
    buffers to the gate."""
    taken = []  # the number of key segments of each stacked call
    stacked = block_attention.stacked
    monkeypatch.setattr(block_attention, "stacked", lambda q, keys, *rest: taken.append(len(keys)) or stacked(q, keys, *rest))
    prompt, reference = references[family]
    assert _run(engines[family], prompt, speculative=False)[0] == reference[:N_TOKENS]
    assert 1 in exact_attention_calls and not taken  # target-alone decode steps (and 16-token prefill chunks)
    test_random_drafter_is_lossless(engines, references, family)
    assert not taken  # no stacked call: the drafter's blocks too went to the exact kernel's gate
    drafter, target = engines[family].drafter, engines[family].target
    context = drafter.make_cache()
    drafter.add_context(target.forward(mx.array(prompt)[None], target.make_cache(16),
                                       drafter.config.target_layer_ids).tapped_hidden, context)
    exact_attention_calls.clear()
    mx.eval(drafter.propose(mx.array([1]), target, context))
    assert exact_attention_calls == [drafter.block_size] * len(drafter.layers)  # a draft: its layers' blocks
    _check_every_acceptance_length(engines, references, family)
    # A verify-sized forward of the target sends every attention layer through the exact kernel.
    target = engines[family].target
    cache = target.make_cache(max_rollback=16)
    target.forward(mx.array(prompt)[None], cache)
    exact_attention_calls.clear()
    mx.eval(target.forward(mx.arange(16)[None], cache).logits)
    assert exact_attention_calls == [16] * sum(not getattr(layer, "is_linear", False) for layer in target.layers)


@pytest.mark.parametrize("why", ["option-off", "long-context"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_drafter_blocks_through_the_stacked_gemms_are_lossless(engines, references, family, why, monkeypatch,
                                                              exact_attention_calls):
    """The drafter's blocks attend over [context ; block] as two key segments, which on CUDA the
    stacked GEMMs take (kernels/attention.py), not the exact kernel: with `drafter_exact_attention`
    off, or with it on where the context is too large to copy (`JOIN_MAX_BYTES`, 0 here); the
    drafts change in their last bits at most, the output not at all."""
    from dataclasses import replace

    taken = []
    stacked = block_attention.stacked
    monkeypatch.setattr(block_attention, "stacked", lambda q, keys, *rest: taken.append(len(keys)) or stacked(q, keys, *rest))
    engine = engines[family]
    drafter = engine.drafter
    if why == "option-off":
        drafter = drafter.with_kernels(replace(drafter.kernels, drafter_exact_attention=False))
    else:
        monkeypatch.setattr(block_attention, "JOIN_MAX_BYTES", 0)
    two_segments = Engine(engine.target, engine.tokenizer, drafter, prefill_chunk=engine.prefill_chunk)
    prompt, reference = references[family]
    tokens, last = _run(two_segments, prompt)
    assert tokens == reference[:N_TOKENS] and last.stats.cycles > 0
    assert set(taken) == {2}  # the drafter's blocks, and nothing else


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_5_moe", "gemma4"])
def test_stacked_projections_are_lossless(request, references, family, monkeypatch, stack_lookups):
    """Projections sharing an input stacked at load into one matrix, one GEMM each (as on CUDA),
    run here on the CPU: speculative output equals target-alone output, which on this CPU is also
    what the unstacked model gives (so the split hands each layer its own columns)."""
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    target, drafter = request.getfixturevalue(f"{family}_pair")
    engine = load_engine(str(target), str(drafter), prefill_chunk=16)
    assert engine.target.shared_input_groups()
    prompt = _prompt(engine)
    reference, _ = _run(engine, prompt, max_tokens=N_TOKENS + 16, speculative=False)
    assert (prompt, reference) == references[family]
    tokens, _ = _run(engine, prompt)
    assert tokens == reference[:N_TOKENS]
    _check_every_acceptance_length({family: engine}, {family: (prompt, reference)}, family)
    # Every group the forwards (target's and drafter's) multiply by one input found its stack: the
    # groups listed at load match the lists the forwards pass to `linears`.
    assert stack_lookups and all(stack_lookups)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rollback_from_step_states_is_lossless(engines, references, family, step_states):
    """Verifies keep every step's GatedDeltaNet state and rollbacks pick one."""
    base = engines[family]
    engine = Engine(step_states(base.target), base.tokenizer, base.drafter, prefill_chunk=16)
    _check_every_acceptance_length({family: engine}, references, family)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rollback_from_step_deltas_is_lossless(engines, family, monkeypatch, step_deltas):
    """Verifies keep each step's GatedDeltaNet delta and rollbacks replay the kept updates
    (`KernelOptions.step_deltas`, for CUDA), the whole pure-MLX path on the uncompiled steps whose
    roundings a replay repeats (`gated_delta.reference_steps`): speculative output is the
    target-alone output at every acceptance length, and the rollbacks did replay."""
    from dflash_core.adapters import qwen3_5

    replays, replay = [], qwen3_5.replay
    monkeypatch.setattr(qwen3_5, "replay", lambda *a: replays.append(a[-1]) or replay(*a))
    base = engines[family]
    engine = Engine(step_deltas(base.target), base.tokenizer, base.drafter, prefill_chunk=16)
    prompt = _prompt(engine)
    reference, _ = _run(engine, prompt, max_tokens=N_TOKENS + 16, speculative=False)
    _check_every_acceptance_length({family: engine}, {family: (prompt, reference)}, family)
    assert replays and {keep for keeps in replays for keep in keeps} >= set(range(1, 16))


def test_gemma4_moe_is_lossless(gemma4_moe_pair):
    """Gemma 4 with its MoE block (router through `linear`, experts in MLX's gathered products):
    a verify gives each token the logits of single steps to the bit, and speculative output is the
    target-alone output with the random drafter, every acceptance length and seeded sampling."""
    from forced import assert_verify_is_single_steps

    from dflash_core.sampling import SamplingParams

    engine = load_engine(*map(str, gemma4_moe_pair), prefill_chunk=16)
    assert all(layer.enable_moe for layer in engine.target.layers)
    prompt = _prompt(engine)
    assert_verify_is_single_steps(engine.target, (prompt * 8)[:100], prompt[:16])
    reference, _ = _run(engine, prompt, max_tokens=N_TOKENS + 16, speculative=False)
    tokens, last = _run(engine, prompt)
    assert last.stats.cycles > 0 and tokens == reference[:N_TOKENS]
    _check_every_acceptance_length({"gemma4_moe": engine}, {"gemma4_moe": (prompt, reference)}, "gemma4_moe")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    assert _run(engine, prompt, sampling=sampling)[0] == _run(engine, prompt, sampling=sampling, speculative=False)[0]


def _check_every_acceptance_length(engines, references, family, drafts_ahead=True):
    engine = engines[family]
    prompt, reference = references[family]
    forced = ForcedDrafter(
        reference=list(prompt) + reference,
        prompt_length=len(prompt),
        schedule=SCHEDULE,
        vocab_size=engine.target.vocab_size,
        target_layer_ids=engine.drafter.config.target_layer_ids,
        drafts_ahead=drafts_ahead,
    )
    forced_engine = Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)
    tokens, last = _run(forced_engine, prompt)
    assert tokens == reference[:N_TOKENS]
    # Every cycle but the first (after the prefill) was drafted ahead, or none was; the output's
    # end can leave the next two blocks drafted (a cycle is queued before the one before it is
    # handed out, and it drafts the one after it).
    if drafts_ahead:
        assert last.stats.cycles - 1 <= forced.drafted_ahead <= last.stats.cycles + 1
    else:
        assert forced.drafted_ahead == 0
    stats = last.stats
    # The schedule really happened: full schedule sweeps, every length seen, positions counted.
    assert stats.cycles >= len(SCHEDULE)
    per_cycle = [SCHEDULE[i % len(SCHEDULE)] for i in range(stats.cycles)]
    assert set(per_cycle) == set(range(16))
    # The token budget can cut the last cycle: statistics count only the drafts handed out.
    before_last = 1 + sum(a + 1 for a in per_cycle[:-1])
    per_cycle[-1] = min(per_cycle[-1], N_TOKENS - before_last)
    assert stats.draft_tokens_accepted == sum(per_cycle) <= stats.generated_tokens - 1
    assert stats.accepted_by_position[0] == sum(1 for a in per_cycle if a >= 1)
    assert stats.accepted_by_position[14] == sum(1 for a in per_cycle if a == 15)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_eos_and_budget_mid_block(engines, references, family):
    """A stop token or the token budget inside a multi-token commit ends the output exactly there."""
    engine = engines[family]
    prompt, reference = references[family]
    forced = ForcedDrafter(list(prompt) + reference, len(prompt), [15], engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    forced_engine = Engine(engine.target, engine.tokenizer, forced)
    # Budget that ends inside the second full-acceptance cycle.
    chunks = list(forced_engine.generate(prompt, max_tokens=21, stop_token_ids=set()))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[:21] and chunks[-1].finish_reason == "length"
    # Statistics count what was handed out: 15 drafts, then 4 of the second cycle's 15.
    stats = chunks[-1].stats
    assert (stats.cycles, stats.draft_tokens_accepted, stats.accepted_by_position[3:5]) == (2, 19, [2, 1])
    # A stop token first produced at index 9 (inside the first cycle's 16 tokens).
    stop = reference[9]
    first = reference.index(stop)
    chunks = list(forced_engine.generate(prompt, max_tokens=200, stop_token_ids={stop}))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[:first] and chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats.generated_tokens == first
    assert chunks[-1].stats.draft_tokens_accepted == first  # the drafts before the stop token, and it


def test_bad_requests_are_refused_and_a_stop_at_once_gives_sane_stats(engines):
    engine = engines["qwen3"]
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], max_tokens=4)
    with pytest.raises(RequestError, match="token ids"):
        engine.generate([1, engine.target.vocab_size], max_tokens=4)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.generate([1, 2], max_tokens=0)
    # The first token is a stop token: nothing is generated, and speeds are zero, not negative.
    prompt = _prompt(engine)
    first = next(t for c in engine.generate(prompt, max_tokens=1, stop_token_ids=set()) for t in c.token_ids)
    for speculative in (False, True):
        chunks = list(engine.generate(prompt, max_tokens=5, stop_token_ids={first}, speculative=speculative))
        stats = chunks[-1].stats
        assert (stats.generated_tokens, chunks[-1].finish_reason, stats.decode_tokens_per_second) == (0, "stop", 0.0)
