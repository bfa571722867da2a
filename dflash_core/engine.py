"""The DFlash decode loop and its target-alone twin, over the same adapters and the same sampler.

`Engine.generate` is the streaming API: an iterator of `GenerationChunk`s (token ids and the text
they complete, optionally their log-probabilities), the last one carrying the finish reason and
`GenerationStats`. Each `next()` does a bounded amount of device work (one prefill chunk or one
cycle), so a scheduler can interleave many generations fairly, and closing the iterator cancels the
generation and frees its caches. A grammar (grammar.py) constrains both loops alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .adapters import ForwardRow, TargetAdapter
from .batching import DraftCall, TargetCall, serve_alone
from .cache import cache_arrays
from .decode_state import DecodeState, DraftedAhead, Launched, device_acceptance
from .detokenize import IncrementalDetokenizer, TokenBytes
from .drafter import DFlashDrafter
from .grammar import AllConstraints, CompiledGrammar, Constraint, GrammarSpec, ReasoningBudget, compile_grammar, tokenizer_info
from .host_reads import RoundQueue
from .logprobs import MAX_TOP_LOGPROBS, LogprobScorer, TokenLogprob
from .prefill import ChunkPacer, chunk_ends
from .prefix_cache import PrefixCache
from .prompts import hf_tokenizer
from .sampling import Sampler, SamplingParams
from .speculation import MODES, ModelSpeculation, SpeculationPolicy
from .stats import GenerationStats

# The rollback room of the caches of an engine without a drafter: the released drafters' block,
# so that they are shaped as a speculating engine's are.
ROLLBACK_WITHOUT_DRAFTER = 16
# The token budget of max_tokens=None: a generation then ends at a stop token or at the context
# limit. An int all the same (the budget is compared and sliced with), one that nothing reaches.
NO_TOKEN_LIMIT = 1 << 62


@dataclass
class GenerationChunk:
    token_ids: list[int]
    text: str
    # "stop" (an end-of-sequence token, or a grammar complete with no stop token to end on) or "length"
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None  # the statistics as of this chunk, final on the last one
    stop_token_id: Optional[int] = None  # the end-of-sequence token that ended it (not in token_ids)
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, when asked for


class RequestError(ValueError):
    """A request the engine cannot serve as asked (reported to clients as a 400)."""


def choose(sampler: Sampler, out, drafts: Optional[mx.array], first_index: int,
           allowed: Optional[mx.array] = None) -> mx.array:
    """`sampler.choose` on a forward's logits rows; a greedy row of a batched forward with no
    penalty or mask takes the batch's one argmax instead (`TargetOutput.choices`, taken after the
    row's logit bias where it has one: the same tokens, without the row's own slice, cast, bias and
    reduction on the host's graph)."""
    if out.choices is not None and allowed is None and sampler.takes_batch_choice(out.choices_bias):
        return out.choices
    return sampler.choose(out.logits[0], drafts, first_index, allowed)


def accepted_length(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix where each draft equals the target's choice before it."""
    n = 0
    while n < len(drafts) and drafts[n] == choices[n]:
        n += 1
    return n


class Engine:
    def __init__(
        self,
        target: TargetAdapter,
        tokenizer,
        drafter: Optional[DFlashDrafter] = None,
        *,
        prefill_chunk: int = 2048,
        prefill_seconds: Optional[float] = None,
        max_context: Optional[int] = None,
        drafter_off_reason: Optional[str] = None,
        prefix_cache: Optional[PrefixCache] = None,
        speculation: str = "on",
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.prefill_chunk = prefill_chunk
        # Paced prefill: chunks of up to prefill_chunk tokens, each sized to take prefill_seconds.
        self.prefill_pacer = ChunkPacer(prefill_seconds, prefill_chunk) if prefill_seconds else None
        self.max_context = max_context
        # Why there is no drafter, reported with every generation that runs without one.
        self.drafter_off_reason = drafter_off_reason or "no drafter configured"
        self.prefix_cache = prefix_cache
        # Caches keep room to roll back one block in every mode, so snapshots fit every request.
        self.max_rollback = drafter.block_size if drafter is not None else ROLLBACK_WITHOUT_DRAFTER
        if speculation not in MODES:
            raise ValueError(f"speculation must be one of {MODES}, got {speculation!r}")
        self.speculation = speculation  # what generate() does unless told otherwise
        # What `auto` times steps and rounds by (seconds): the wall clock, or in a test a clock
        # that a cost model advances, so that a test of auto's choices does not hang on the
        # load of the machine running it.
        self.clock = clock
        # What `auto` measured on this machine, kept across this model's generations.
        held_out = getattr(drafter, "held_out_acceptance", None)
        self.speculation_state = (ModelSpeculation(drafter.block_size, held_out.through if held_out else None)
                                  if drafter is not None else None)
        # Cache bytes per token held, the largest a finished generation had (target and drafter):
        # what a scheduler admits new generations by. None until one finished.
        self.cache_bytes_per_token: Optional[float] = None
        self._grammar_tokenizer = None
        self._token_bytes: Any = False  # not looked at yet (None: the tokenizer is not byte-level)
        # What the batched generations queued for evaluation and host reads since
        # `batching.step_together` last started them: one `mx.async_eval` and one read for all rows
        # instead of one each (docs/performance.md, "dflash train's generation", "One read a round").
        self.batch_queue = RoundQueue()

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def token_bytes(self) -> Optional[TokenBytes]:
        """Each token's bytes, for byte-level BPE tokenizers (built on first use, then kept)."""
        if self._token_bytes is False:
            self._token_bytes = TokenBytes.for_tokenizer(self.tokenizer)
        return self._token_bytes

    @property
    def grammar_tokenizer(self):
        """llguidance's view of the vocabulary, built on the first grammar (it takes a while for
        large vocabularies) and kept: pass it to `grammar.compile_grammar`."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = tokenizer_info(hf_tokenizer(self.tokenizer), self.target.vocab_size)
        return self._grammar_tokenizer

    def generate(
        self,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: Optional[int] = None,
        sampling: SamplingParams = SamplingParams(),
        speculative: bool = True,
        speculation: Union[str, SpeculationPolicy, None] = None,
        stop_token_ids: Optional[set[int]] = None,
        logprobs: Optional[int] = None,
        grammar: Union[GrammarSpec, CompiledGrammar, None] = None,
        reasoning_budget: Optional[tuple[int, int]] = None,
        batched: bool = False,
    ) -> Iterator[GenerationChunk]:
        """Stream the generation of up to `max_tokens` tokens after `prompt_tokens`.

        `logprobs`: None (off) or k in 0..20: each chunk's `logprobs` gives, for each token, its
        log-probability and the k most likely tokens, from log_softmax of the target's raw logits at
        that position: before logit_bias, penalties, temperature, top-k/top-p/min-p and the grammar
        (what OpenAI and vLLM report by default), so a token sampled at a temperature or forced by a
        grammar may be unlikely, or outside the top k.
        `grammar`: the output must match it: a GrammarSpec (GrammarError here if it is unusable) or
        what `grammar.compile_grammar(spec, engine.grammar_tokenizer)` made of one, to validate it
        before queuing. The output ends with a stop token once the grammar is complete, or right
        there if the request has no stop tokens (finish "stop", no stop_token_id).
        `reasoning_budget`: (end token, n) for a prompt that opened a reasoning block: the block
        ends within n tokens, its end token forced then (grammar.ReasoningBudget).
        `speculation`: "auto" (cycles only while they beat plain target steps on this machine,
        `speculation.AutoSpeculation`), "on" (every step a full cycle), "off" (the target alone),
        or a SpeculationPolicy choosing each step; None: the engine's `speculation`.
        `speculative=False` is "off".
        `batched=True`: the stream also yields the forwards it needs (`batching.TargetCall`,
        `batching.DraftCall`) and takes their outputs back through `send`, so that a scheduler can
        run the forwards of several generations as one (`batching.step_together`).
        """
        if not prompt_tokens:
            raise RequestError("the prompt is empty")
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        vocab = self.target.vocab_size
        if not all(0 <= t < vocab for t in prompt_tokens):  # the model would read garbage embeddings
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        sampling.validate(self.target.vocab_size)
        if logprobs is not None and (isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
        budget = max_tokens if max_tokens is not None else NO_TOKEN_LIMIT
        if self.max_context is not None:
            budget = min(budget, self.max_context - len(prompt_tokens))
        if budget < 1:
            raise RequestError(f"no room to generate: prompt has {len(prompt_tokens)} tokens, limit {self.max_context}")
        mode = "off" if not speculative else (speculation or self.speculation)
        if isinstance(mode, str) and mode not in MODES:
            raise RequestError(f"speculation must be one of {', '.join(MODES)}, got {mode!r}")
        stats = GenerationStats(prompt_tokens=len(prompt_tokens), prefill_tokens=len(prompt_tokens),
                                speculation=mode if isinstance(mode, str) else getattr(mode, "name", "custom"))
        policy = None
        if self.drafter is None:
            stats.speculative_off_reason = self.drafter_off_reason
        elif mode == "off":
            stats.speculative_off_reason = "disabled by request"
        else:
            stats.speculative = True
            stats.block_size = self.drafter.block_size
            stats.accepted_by_position = [0] * (self.drafter.block_size - 1)
            stats.verified_by_position = [0] * (self.drafter.block_size - 1)
            policy = mode if not isinstance(mode, str) else self.speculation_state.policy(mode, batched)
        eos = self.eos_token_ids if stop_token_ids is None else set(stop_token_ids)
        constraint = None
        if grammar is not None:
            if isinstance(grammar, GrammarSpec):
                grammar = compile_grammar(grammar, self.grammar_tokenizer)
            elif grammar.tokenizer.vocab_size < vocab:
                raise RequestError(f"the grammar was compiled for a vocabulary of {grammar.tokenizer.vocab_size} tokens, "
                                   f"not {vocab}")
            constraint = Constraint(grammar, vocab, eos)
        if reasoning_budget is not None:
            limit = ReasoningBudget(*reasoning_budget, vocab)
            constraint = limit if constraint is None else AllConstraints([constraint, limit])
        scorer = LogprobScorer(logprobs, vocab)
        queue = self.batch_queue if batched else None
        steps = self._stream(list(prompt_tokens), budget, sampling, stats, eos, scorer, constraint, policy, queue)
        return steps if batched else serve_alone(self, steps)

    def _stream(self, prompt, budget, sampling, stats, eos, scorer, constraint, policy,
                eval_queue: Optional[RoundQueue] = None) -> Iterator[GenerationChunk]:
        start = time.perf_counter()
        hit = self.prefix_cache.lookup(prompt, need_context=stats.speculative) if self.prefix_cache else None
        if hit is not None:
            cache, context = hit.restore()
            state = DecodeState(cache, context if stats.speculative else None, list(hit.tokens))
            stats.prefill_tokens = len(prompt) - len(hit.tokens)
        else:
            context = self.drafter.make_cache() if stats.speculative else None
            state = DecodeState(self.target.make_cache(max_rollback=self.max_rollback), context, [])
        state.eval_queue = eval_queue
        sampler = Sampler(sampling, self.target.vocab_size, prompt)
        if stats.speculative:
            steps = self._speculative(prompt, sampler, state, hit, scorer, constraint, policy)
        else:
            steps = self._target_only(prompt, sampler, state, hit, scorer, constraint)
        no_logprobs = None if scorer.k is None else []
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.token_bytes)
        produced: list[int] = []  # every token the loop committed, before any cut
        decode_start = None
        try:
            # Each commit: its tokens, their logprobs, and what made them: None for the prefill's
            # token, 0 for a plain target step, else the width of a cycle. Forwards the steps need
            # go out to whoever runs this stream, and their outputs come back.
            for item in steps:
                while isinstance(item, (TargetCall, DraftCall)):
                    item = steps.send((yield item))
                ids, logprobs, width = item
                if not ids:  # a prefill chunk: give the caller a chance to interleave
                    yield GenerationChunk([], "", stats=stats.copy(), logprobs=no_logprobs)
                    continue
                produced += ids
                drafts_in_cycle = len(ids) - 1
                now = time.perf_counter()
                if decode_start is None:
                    decode_start = now
                    stats.prefill_seconds = now - start
                ids = ids[: budget - stats.generated_tokens]
                finish = "length" if stats.generated_tokens + len(ids) >= budget else None
                end = constraint.end if constraint is not None else None  # a complete grammar, no stop token
                if end is not None and stats.generated_tokens + len(ids) >= end:
                    ids, finish = ids[: end - stats.generated_tokens], "stop"
                stop_token = None
                for i, token in enumerate(ids):
                    if token in eos:
                        ids, finish, stop_token = ids[:i], "stop", token
                        break
                logprobs = logprobs[: len(ids)] if logprobs is not None else None
                if width:
                    # Count the drafts handed out (or ending the output as its stop token), not
                    # those a max_tokens or stop-token cut threw away.
                    stats.record_cycle(min(drafts_in_cycle, len(ids) + (stop_token is not None)), width)
                    stats.tokens_from_cycles += len(ids)
                elif width == 0 and stats.speculative:
                    stats.plain_steps += 1
                    stats.tokens_from_steps += len(ids)
                if policy is not None:
                    stats.speculation_note = policy.note()
                stats.generated_tokens += len(ids)
                text = detokenizer.add(ids)
                stats.decode_seconds = time.perf_counter() - decode_start
                if finish:
                    kept = stats.generated_tokens + (stop_token is not None)
                    self._remember_generation(state, prompt, produced, kept)
                    yield GenerationChunk(ids, text + detokenizer.flush(), finish, stats.copy(), stop_token, logprobs)
                    return
                yield GenerationChunk(ids, text, stats=stats.copy(), logprobs=logprobs)
        finally:
            steps.close()
            self._measure_caches(state)
            # The batched rows' stacked buffers hold this generation's caches' memory: let it go
            # now (the rows left stack theirs anew at their next step).
            for model in (self.target, self.drafter):
                stacked = getattr(model, "stacked_rows", None)
                if stacked is not None:
                    stacked.clear()

    def _measure_caches(self, state: DecodeState) -> None:
        if state.fed:
            held = sum(a.nbytes for a in cache_arrays(state.cache) + cache_arrays(state.context or []))
            self.cache_bytes_per_token = max(self.cache_bytes_per_token or 0.0, held / len(state.fed))

    def _remember_generation(self, state: DecodeState, prompt, produced, kept: int) -> None:
        """Snapshot the end of a finished generation when the caches hold only tokens that were
        handed out (the next turn of a conversation starts with them). The snapshot this request
        started from is gone by now: the prompt's own snapshots, which extend it, pruned it
        (prefix_cache.py); a retry or an edited last message restores the prompt's last message
        boundaries, which were stored."""
        generated = state.fed[len(prompt) :]
        if self.prefix_cache is not None and len(generated) <= kept and generated == produced[: len(generated)]:
            state.settle(self.target)
            if state.pending is not None:  # undo the step queued ahead that will not be read
                self.target.rollback(state.cache, state.pending, keep=0)
                state.pending = None
            state.catch_up(self.drafter)  # (the taps of the last steps, speculating generations only)
            self.prefix_cache.insert(state.fed, state.cache, state.context)

    def _snapshot_points(self, prompt, start: int) -> tuple[list[int], Optional[int]]:
        """Message boundaries (after end-of-turn tokens) worth a snapshot: the first one, shared
        by conversations with the same system prompt, and the last two."""
        if self.prefix_cache is None:
            return [], None
        eos = self.eos_token_ids
        ends = [i + 1 for i, t in enumerate(prompt[:-1]) if t in eos]
        first = ends[0] if ends and ends[0] > start else None
        points = sorted({p for p in ends[-2:] + ([first] if first else []) if p > start})
        return points, first

    def _prefill(self, prompt, state: DecodeState, tap_ids=(), hit=None):
        """Chunked prefill from the cached prefix on; yields between chunks, snapshots at message
        boundaries and at the end, and returns the last position's logits [1, V]."""
        start = len(state.fed)
        if start == len(prompt):  # the whole prompt was cached, with its logits
            return hit.logits[None]
        boundaries, first = self._snapshot_points(prompt, start)
        tokens = mx.array(prompt, dtype=mx.int32)[None]
        begin = start
        for end in chunk_ends(start, len(prompt), boundaries, self.prefill_chunk, self.prefill_pacer):
            if self.prefill_pacer is not None and end < len(prompt):
                # Time this chunk alone: work queued before it (the steps of generations batched
                # with this one) would otherwise count as prefill time and shrink the next chunks.
                mx.synchronize()
            began = time.perf_counter()
            out = self.target.forward(tokens[:, begin:end], state.cache, tap_ids, last_logits_only=True)
            if state.context is not None:
                self.drafter.add_context(out.tapped_hidden, state.context)
            state.fed += prompt[begin:end]
            if end < len(prompt):
                # Bound the graph and the memory of one chunk: the drafter's context too, whose
                # write would otherwise hold every chunk's taps until the first cycle (at 32K
                # tokens of the Qwen3.5-9B shape, 1.3 GB).
                mx.eval(out.logits, cache_arrays(state.cache), cache_arrays(state.context or []))
                if self.prefill_pacer is not None:
                    self.prefill_pacer.record(end - begin, time.perf_counter() - began)
            if end in boundaries:
                self.prefix_cache.insert(state.fed, state.cache, state.context, shared=end == first, extends=hit)
            if end < len(prompt):
                yield [], None, None
            begin = end
        logits = out.logits[0]
        if self.prefix_cache is not None:
            self.prefix_cache.insert(state.fed, state.cache, state.context, logits=logits[0], extends=hit)
        return logits

    def _target_only(self, prompt, sampler: Sampler, state: DecodeState, hit, scorer: LogprobScorer,
                     constraint: Optional[Constraint]) -> Iterator[tuple[list[int], Optional[list[TokenLogprob]]]]:
        logits = yield from self._prefill(prompt, state, (), hit)
        token = sampler.choose(logits, None, 0, constraint.masks() if constraint else None)
        scored = scorer.queue(logits, token)
        read = state.read_later(token)
        index = 0
        while True:
            sampler.commit(token)
            out = yield TargetCall(ForwardRow(token[None], state.cache, logit_bias=sampler.batch_bias))
            if constraint is not None:  # the next mask needs this token: read it while the step runs
                mx.async_eval(out.logits)
                constraint.commit(token.tolist())
            # Queue the next step before reading this token: the device never waits for the host.
            next_token = choose(sampler, out, None, index + 1, constraint.masks() if constraint else None)
            next_read = state.read_later(next_token)
            next_scored = scorer.queue(out.logits[0], next_token)
            committed = read.tolist()
            state.fed += committed
            yield committed, scorer.read(scored, committed), 0
            token, read, scored, index = next_token, next_read, next_scored, index + 1

    def _speculative(self, prompt, sampler: Sampler, state: DecodeState, hit, scorer: LogprobScorer,
                     constraint: Optional[Constraint], policy: SpeculationPolicy):
        """Each step is a draft-verify cycle or a plain target step, as `policy` plans it; both feed
        the drafter's context and commit exactly the target's tokens. The next step is queued
        before the host hands out this one's tokens, so the device never waits for the host; a
        plain step followed by another is queued even before this one is read (its input is this
        one's output, still on the device), as target-alone decoding does."""
        logits = yield from self._prefill(prompt, state, self.drafter.config.target_layer_ids, hit)
        token = sampler.choose(logits, None, 0, constraint.masks() if constraint else None)
        scored = scorer.queue(logits, token)
        sampler.commit(token)
        index = 0  # generated-token index of `token`: committed, not yet fed to the target
        first = token.tolist()  # the first token goes out before the first step is queued
        state.last = first[0]
        logprobs = scorer.read(scored, first)
        if constraint is not None:
            constraint.commit(first)
        width = policy.plan(len(state.fed))
        step = yield from self._launch(token, index, width, sampler, state, scorer, constraint,
                                       self._width_ahead(policy, width, constraint))
        yield first, logprobs, None
        # The first step is not timed: it ran while `first` went out, and a cycle also wrote the
        # prompt's taps into the drafter's context (the prefill leaves them queued).
        read = None
        queued_early = False  # `step` was queued before the step ahead of it was read
        while True:
            ahead, planned = None, None
            if width == 0 and constraint is None:  # (a grammar's next mask needs this token's value)
                planned = policy.plan(len(state.fed) + 1)
                if planned == 0:
                    ahead = yield from self._launch(step.choice, index + 1, 0, sampler, state, scorer, constraint)
            committed, token, logprobs, accepted = step.read()  # the one blocking read of a step
            now = self.clock()
            # Read to read is a step's time where it and the next were queued alike: within a run
            # of plain steps each queued a step early, or none. At a run's edges it is not: the
            # first (queued after a cycle's read) also pays for building the second, and the last
            # was already done when the one before it was read (about 0 ms).
            timed = read is not None and queued_early == (ahead is not None)
            policy.observe(width, len(state.fed), now - read if timed else None, accepted)
            read, queued_early = now, ahead is not None
            index += len(committed)
            done = width
            if ahead is not None:
                step = ahead
            else:
                width = planned if planned is not None else policy.plan(len(state.fed))
                step = yield from self._launch(token, index, width, sampler, state, scorer, constraint,
                                               self._width_ahead(policy, width, constraint), step.ahead)
            yield committed, logprobs, done

    def _width_ahead(self, policy: SpeculationPolicy, width: int, constraint: Optional[Constraint]) -> int:
        """For a cycle of `width` about to be queued: the width to draft the next cycle at behind
        its verify, before the host reads it (0: none). That is this cycle's width while the policy
        says the next step is likely a cycle of it (`cycles_next`, else `speculating`; the next plan,
        made after the read, uses the drafts if it picks that width, else they are dropped). Only
        drafters that can draft a block at a position on the device do this (`drafts_ahead`); a
        grammar's masks need the host to read each cycle first."""
        if width == 0 or constraint is not None or not getattr(self.drafter, "drafts_ahead", False):
            return 0
        cycles_next = getattr(policy, "cycles_next", None)
        keeps = cycles_next(width) if cycles_next is not None else getattr(policy, "speculating", False)
        return width if keeps else 0

    def _launch(self, token, index: int, width: int, sampler: Sampler, state: DecodeState,
                scorer: LogprobScorer, constraint: Optional[Constraint], next_width: int = 0,
                drafted: Optional[DraftedAhead] = None):
        """Queue one step from `token` (committed to the sampler, not yet fed to the target; width 0:
        a plain step, else a cycle verifying `token` and width-1 drafts). Its `read()` gives
        (committed tokens, the next `token`, their logprobs, drafts accepted); a plain step's
        `choice` is its output, on the device. Each step adds its input to `state.fed` when read (a
        cycle its taps to the drafter's context; a plain step keeps them in `state.untapped`), and
        leaves its rollback record in `state.pending` until then, so a generation that ends with a
        step queued can undo it.

        A cycle given `next_width` also queues the next cycle's drafts (that wide) behind its verify,
        from its acceptance on the device (`DraftedAhead`): the device drafts while the host reads
        this cycle and builds the next verify, which then takes `drafted` if it is as wide."""
        drafter, cache, context = self.drafter, state.cache, state.context
        tap_ids = drafter.config.target_layer_ids
        if width == 0:
            row = ForwardRow(token[None], cache, record=True, undo=state.take_due(), logit_bias=sampler.batch_bias)
            out = yield TargetCall(row, tap_ids)
            choice = choose(sampler, out, None, index + 1, constraint.masks() if constraint else None)
            sampler.commit(choice)  # on the device: a step queued after this one samples after it
            read = state.read_later(choice, out.tapped_hidden)
            scored = scorer.queue(out.logits[0], choice)
            state.pending = out.rollback

            def read_step():
                if state.pending is out.rollback:
                    state.pending = None
                state.untapped.append(out.tapped_hidden)
                state.fed.append(state.last)  # `token`: known by now, the step before was read first
                committed = read.tolist()
                state.last = committed[-1]
                if constraint is not None:
                    constraint.commit(committed)
                return committed, choice, scorer.read(scored, committed), 0

            return Launched(read_step, choice)
        # The drafter's context takes the taps since the last cycle (its accepted positions, the
        # plain steps' since) in the same call as the draft: batched, one write for all rows.
        if drafted is not None and drafted.width == width:
            drafts = drafted.drafts  # queued behind the last verify
        else:
            drafts = yield DraftCall(token, context, width, state.take_untapped())
            state.evaluate(drafts)  # the draft runs while the verify graph is built
        verify = yield TargetCall(ForwardRow(mx.concatenate([token, drafts])[None], cache, record=True,
                                             undo=state.take_due(), logit_bias=sampler.batch_bias), tap_ids)
        allowed = None
        if constraint is not None:  # each row's mask follows the drafts before it: read them
            mx.async_eval(verify.logits, verify.tapped_hidden)  # the verify runs while the host builds masks
            allowed = constraint.masks(drafts.tolist())
        choices = choose(sampler, verify, drafts, index + 1, allowed)
        # What the host reads, joined on the device as part of this step (in a batch, with the
        # other rows' into one array: one read for the round, `host_reads`).
        read = state.read_later(mx.concatenate([drafts, choices]), verify.tapped_hidden)
        state.pending = verify.rollback
        scored = scorer.queue(verify.logits[0], choices)
        ahead = None
        if next_width:
            # All of the verify's taps into the drafter's context, and a block from the device's
            # reading of the acceptance; the host trims the rejected positions' taps when it reads.
            before = context[0].offset
            accepted_on_device, bonus = device_acceptance(drafts, choices)
            start = (accepted_on_device + (before + 1)).astype(mx.int32)
            drafts_ahead = yield DraftCall(bonus, context, next_width, verify.tapped_hidden, (start, before + 1))
            if drafts_ahead is not None:
                state.evaluate(drafts_ahead)
                ahead = DraftedAhead(drafts_ahead, next_width, before)
                state.context_committed = before

        def read_cycle():
            host = read.tolist()
            proposed, picks = host[: width - 1], host[width - 1 :]
            accepted = accepted_length(proposed, picks)
            state.due = (verify.rollback, accepted + 1)  # applied with the next forward
            state.pending = None
            if ahead is not None:
                state.trim_context(ahead.context_before + accepted + 1)
            else:
                state.untapped.append(verify.tapped_hidden[:, : accepted + 1])
            state.fed += [state.last] + proposed[:accepted]  # `token` and the accepted drafts
            committed = proposed[:accepted] + [picks[accepted]]
            state.last = committed[-1]
            sampler.commit(mx.array(committed, dtype=mx.int32))
            if constraint is not None:
                constraint.commit(committed)
            return committed, choices[accepted : accepted + 1], scorer.read(scored, committed), accepted

        return Launched(read_cycle, ahead=ahead)
