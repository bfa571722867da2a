"""Grammar-constrained decoding with llguidance: any JSON object, a JSON schema, a regular expression
or a Lark grammar, for target-alone and speculative decoding alike.

A `Constraint` turns the grammar's state into allow-masks for the sampler: row 0 for the state after
the committed tokens, row i for the state after also drafts[:i]. Each verify row then chooses
exactly the token target-alone constrained decoding would choose after the same tokens, so
accepting drafts that equal the choices stays lossless (sampling.py). A draft the grammar forbids
can never equal a masked choice, so acceptance ends there and the rows after it need no real mask.

The generation's stop tokens replace llguidance's end-of-sequence token: they are allowed exactly
when the grammar is satisfied, and once it is complete they are all that is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Optional, Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]


class GrammarError(ValueError):
    """A grammar the engine cannot use (reported to clients as a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    value: Any = None  # the schema (a dict or its JSON text), the regex or the Lark text; none for json_object


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar over one model's vocabulary."""

    spec: GrammarSpec
    text: str  # llguidance's grammar definition
    tokenizer: llguidance.LLTokenizer
    # A matcher at the grammar's start, never advanced: each generation takes a copy (microseconds)
    # instead of building its own on the worker thread, which a large grammar makes slow (an anyOf
    # of 5000 objects: 0.5 s, while every other generation waited).
    start: llguidance.LLMatcher = field(repr=False, compare=False)


def tokenizer_info(hf_tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a model's vocabulary; slow for large vocabularies, so build it once per
    model. Ids past the tokenizer's (embedding rows beyond it) are empty and never allowed."""
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)))
    except ValueError as e:  # llguidance reads the Rust tokenizer of a "fast" one
        raise GrammarError(f"grammars need a fast Hugging Face tokenizer, this model has "
                           f"{type(hf_tokenizer).__name__}: {e}") from e


def compile_grammar(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """Build and validate the grammar; GrammarError with llguidance's message if it is unusable."""
    text = _grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error:
        raise GrammarError(f"invalid {spec.kind} grammar: {messages[0] if messages else 'rejected by llguidance'}")
    return CompiledGrammar(spec, text, tokenizer, llguidance.LLMatcher(tokenizer, text, log_level=0))


def _grammar_text(spec: GrammarSpec) -> str:
    matcher = llguidance.LLMatcher
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": True})
    if spec.kind == "json_schema":
        schema = spec.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        try:
            return matcher.grammar_from_json_schema(json.dumps(schema))
        except (TypeError, ValueError) as e:  # not JSON-serializable, or not a schema llguidance reads
            raise GrammarError(f"invalid json_schema grammar: {e}") from e
    if spec.kind in ("regex", "lark"):
        if not isinstance(spec.value, str) or not spec.value:
            raise GrammarError(f"a {spec.kind} grammar must be a non-empty string")
        return matcher.grammar_from_regex(spec.value) if spec.kind == "regex" else matcher.grammar_from_lark(spec.value)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}: expected json_object, json_schema, regex or lark")


class Constraint:
    """One generation's grammar state: allow-masks for the sampler, advanced by committed tokens."""

    def __init__(self, grammar: CompiledGrammar, vocab_size: int, stop_tokens: Iterable[int]):
        self.matcher = grammar.start.deep_copy()
        self._check()
        self.vocab_size = vocab_size
        self.stop_tokens = {t for t in stop_tokens if 0 <= t < vocab_size}
        self._stops = np.array(sorted(self.stop_tokens), dtype=np.int64)
        self._eos = np.array([t for t in grammar.tokenizer.eos_tokens if t < vocab_size and t not in self.stop_tokens],
                             dtype=np.int64)
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, grammar.tokenizer.vocab_size)
        self.consumed = 0  # tokens the grammar has consumed: the generated tokens so far, stop tokens aside
        self.end: Optional[int] = None  # generated tokens that complete the grammar, when no stop token can follow

    def masks(self, drafts: Sequence[int] = ()) -> mx.array:
        """bool [1 + len(drafts), V]: row 0 for the committed tokens, row i after also drafts[:i].

        The chain ends at a draft the grammar forbids (acceptance ends there) or at a stop token
        (the output ends there); the rows after it allow everything.
        """
        rows = np.ones((1 + len(drafts), self.vocab_size), dtype=bool)
        consumed = 0
        for i in range(len(rows)):
            rows[i] = self._allowed()
            if i == len(drafts) or not rows[i, drafts[i]] or drafts[i] in self.stop_tokens:
                break
            self.matcher.consume_token(drafts[i])
            consumed += 1
        self.matcher.rollback(consumed)
        self._check()
        return mx.array(rows)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past the committed tokens. A stop token ends the output, so nothing after it is
        consumed; neither is anything after the grammar completes with no stop token to end on."""
        for token in tokens:
            if token in self.stop_tokens or self.matcher.is_stopped():
                return
            self.matcher.consume_token(token)
            self._check()
            self.consumed += 1
            if self.matcher.is_stopped() and not self.stop_tokens:
                self.end = self.consumed

    def _allowed(self) -> np.ndarray:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        allowed[self._eos] = False  # llguidance's end of sequence, when it is not one of ours
        allowed[self._stops] = self.matcher.is_accepting()
        return allowed

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar error: {self.matcher.get_error()}")


class ReasoningBudget:
    """The reasoning block the prompt opened ends within `budget` tokens: once it holds that
    many, its end token is the only one allowed. Masks like a `Constraint` (row i after drafts[:i]),
    so speculative and target-alone decoding force it at the same position."""

    end = None  # it never ends the output itself

    def __init__(self, end_token: int, budget: int, vocab_size: int):
        self.end_token, self.budget, self.vocab_size = end_token, budget, vocab_size
        self.open, self.count = True, 0  # whether the block is still open, tokens in it so far

    def masks(self, drafts: Sequence[int] = ()) -> mx.array:
        rows = np.ones((1 + len(drafts), self.vocab_size), dtype=bool)
        is_open, count = self.open, self.count
        for i in range(len(rows)):
            if is_open and count >= self.budget:
                rows[i] = False
                rows[i, self.end_token] = True
            if i < len(drafts):
                is_open, count = (False, count) if drafts[i] == self.end_token else (is_open, count + is_open)
        return mx.array(rows)

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if not self.open:
                return
            if token == self.end_token:
                self.open = False
            else:
                self.count += 1


class AllConstraints:
    """Several constraints at once: a token is allowed where every one allows it."""

    def __init__(self, parts):
        self.parts = parts

    @property
    def end(self) -> Optional[int]:
        return next((p.end for p in self.parts if p.end is not None), None)

    def masks(self, drafts: Sequence[int] = ()) -> mx.array:
        out = self.parts[0].masks(drafts)
        for part in self.parts[1:]:
            out = out & part.masks(drafts)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        for part in self.parts:
            part.commit(tokens)
