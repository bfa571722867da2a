"""What every target adapter offers the engine.

An adapter owns the forward loop of one model family over mlx-lm's own modules and weights
(embedding, decoder layers, final norm, LM head): it never changes mlx-lm's classes. Beyond a plain
forward it returns the hidden states tapped at the drafter's layer ids (each layer's *output*,
HF `hidden_states[i + 1]`), records what an exact rollback needs (`record=True`), and rolls the
caches back to any accepted prefix of the last forward.

Kernel options (`KernelOptions`) are given at construction and read by every forward; the
projections that share an input become `SharedInput`s at construction too (kernels/matmul.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from ..kernels import DEFAULT_KERNELS, KernelOptions
from ..kernels.attention import attention, buffer_mask
from ..kernels.matmul import SharedInput, is_gated_mlp, linear, tied_lm_head


@dataclass
class RollbackRecord:
    """What `rollback()` needs to undo all but a prefix of a recorded forward."""

    tokens: int  # the forward's length
    # Per layer whose cache cannot be trimmed (GatedDeltaNet), in layer order: the adapter's own
    # record of it (qwen3_5.GatedDeltaRecord). Empty where every cache trims.
    states: list = field(default_factory=list)


@dataclass
class TargetOutput:
    """What a target forward returns."""

    logits: mx.array  # [1, rows, V]: every position, or only the last one
    tapped_hidden: Optional[mx.array]  # [1, L, n_taps * H] in tap-id order, None without tap ids
    rollback: Optional[RollbackRecord]  # None unless record=True


@dataclass
class ForwardRow:
    """One generation's part of a batched forward (`TargetAdapter.forward_rows`): its tokens
    [1, L] and its own caches, as `forward` takes them."""

    tokens: mx.array
    cache: list
    last_logits_only: bool = False
    record: bool = False


# Decode and verify forwards (at most this many tokens) run each layer as a few compiled
# functions: building a graph of thousands of small ops on the host otherwise bounds a step.
COMPILED_MAX_TOKENS = 16


def cached_attention(q, k, v, cache, scale: float, start: int, masks: dict, kernels: KernelOptions) -> mx.array:
    """Write k, v into an mlx-lm KVCache and attend. One query (decode): mlx-lm's attention over the
    keys written so far. A block (verify): the cache's whole buffer with its tail masked
    (`buffer_mask`, kept in `masks` by buffer length for the forward's other layers), which on CUDA
    is the block attention."""
    k, v = cache.update_and_fetch(k, v)
    queries = q.shape[2]
    if queries == 1:
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=None)
    k, v = cache.keys, cache.values
    length = k.shape[2]
    if length not in masks:
        masks[length] = buffer_mask(length, start, queries)
    return attention(q, [k], [v], scale, masks[length], kernels)


def gated_mlp_group(mlp: nn.Module) -> dict[str, list[nn.Module]]:
    """{"gate_up": [gate, up]} for a gated MLP (what `gated_mlp` multiplies by one input), {} for
    others (MoE blocks)."""
    return {"gate_up": [mlp.gate_proj, mlp.up_proj]} if is_gated_mlp(mlp) else {}


class TargetAdapter:
    family = "base"

    def __init__(self, model: nn.Module, kernels: KernelOptions = DEFAULT_KERNELS):
        self.model = model
        self.kernels = kernels
        self._compiled_fns: dict = {}
        self.compile_max_tokens = COMPILED_MAX_TOKENS  # 0: every forward eager
        # Vision-language checkpoints wrap the text model; only the language model is served.
        self.text_model = getattr(model, "language_model", model)
        self.inner = self.text_model.model
        self.layers = self.inner.layers
        # Per decoder layer, its groups by name (`layer_groups`), stacked here where that pays.
        self.shared_inputs: list[dict[str, SharedInput]] = [
            {name: SharedInput(group, kernels) for name, group in self.layer_groups(layer).items()}
            for layer in self.layers
        ]

    def with_kernels(self, kernels: KernelOptions) -> "TargetAdapter":
        """This adapter over the same model with other kernel options (benchmarks measure one path
        against another in one process). It shares the weights as stacked at load and the compiled
        functions, which are keyed by the options: switching back traces nothing again."""
        other = copy.copy(self)
        other.kernels = kernels
        return other

    # ----- shapes the drafter is checked against
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.text_model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_model.args.vocab_size

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype (quantized embeddings keep theirs in the scales)."""
        emb = self.inner.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    # ----- lent to the drafter
    def embed(self, tokens: mx.array) -> mx.array:
        """The raw embedding (no family-specific scaling): what DFlash drafters were trained on."""
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """The target's LM head without any family-specific logit post-processing."""
        # The model's own flag where it has one (Gemma 3 decides at load time whether the
        # checkpoint carries a head), else its config's.
        tied = getattr(self.text_model, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(self.text_model.args, "tie_word_embeddings", False)
        if tied:
            return tied_lm_head(self.inner.embed_tokens, hidden, self.kernels)
        return linear(self.text_model.lm_head, hidden, self.kernels)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm and LM head exactly as the mlx-lm model computes them."""
        return self.lm_head(self.inner.norm(hidden))

    def compiled(self, key, make):
        """mx.compile(make()) once per key and kernel options (traced again only for new input
        shapes): `make` builds its block for this adapter's options, which it reads when traced."""
        key = (self.kernels, key)
        fn = self._compiled_fns.get(key)
        if fn is None:
            fn = self._compiled_fns[key] = mx.compile(make())
        return fn

    # ----- the family-specific part
    def layer_groups(self, layer: nn.Module) -> dict[str, list[nn.Module]]:
        """The projections of one decoder layer that its forward multiplies by one input through
        `linears` (q, k, v; gate and up), by name: each becomes a `SharedInput` at load, stacked
        into one matrix where that pays (kernels/matmul.py)."""
        return {}

    def shared_input_groups(self) -> list[list[nn.Module]]:
        """Every decoder layer's groups (`layer_groups`), in layer order."""
        return [group for layer in self.layers for group in self.layer_groups(layer).values()]

    def make_cache(self, max_rollback: int) -> list:
        raise NotImplementedError

    def run_layers(self, tokens: mx.array, cache: list, tap_ids: Sequence[int], states: Optional[list]):
        """Embed and run every decoder layer; returns (last hidden, {layer id: output}). `states`
        (recorded forwards only) gets what rolling back a layer that cannot be trimmed needs."""
        raise NotImplementedError

    def forward(
        self,
        tokens: mx.array,
        cache: list,
        tap_ids: Sequence[int] = (),
        *,
        last_logits_only: bool = False,
        record: bool = False,
    ) -> TargetOutput:
        rollback = RollbackRecord(tokens.shape[1]) if record else None
        h, tapped = self.run_layers(tokens, cache, tap_ids, rollback.states if record else None)
        if last_logits_only:
            h = h[:, -1:]
        tapped_hidden = mx.concatenate([tapped[i] for i in tap_ids], axis=-1) if tap_ids else None
        return TargetOutput(self.logits(h), tapped_hidden, rollback)

    def forward_rows(self, rows: Sequence[ForwardRow], tap_ids: Sequence[int] = ()) -> list[TargetOutput]:
        """One forward for several generations (continuous batching): each row's output, and what
        it does to the row's caches, is exactly what `forward` gives that row alone, while the
        weights are read once for all rows. This fallback runs the rows one after another;
        families override it."""
        return [self.forward(r.tokens, r.cache, tap_ids, last_logits_only=r.last_logits_only, record=r.record)
                for r in rows]

    def rollback(self, cache: list, record: RollbackRecord, keep: int) -> None:
        """Undo all but the first `keep` tokens of the recorded forward."""
        for c in cache:
            if c is not None and record.tokens > keep:
                c.trim(record.tokens - keep)
