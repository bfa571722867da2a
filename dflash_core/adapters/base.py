"""What every target adapter offers the engine.

An adapter owns the forward loop of one model family over mlx-lm's own modules and weights
(embedding, decoder layers, final norm, LM head): it never changes mlx-lm's classes. Beyond a plain
forward it returns the hidden states tapped at the drafter's layer ids (each layer's *output*,
HF `hidden_states[i + 1]`), records what an exact rollback needs (`record=True`), and rolls the
caches back to any accepted prefix of the last forward.

Kernel options (`KernelOptions`) are given at construction and read by every forward; the
projections that share an input become `SharedInput`s at construction too (kernels/matmul.py).

Decode and verify forwards (at most `compile_max_tokens` tokens) of the families that implement
`run_rows` run as rows of `forward_rows`, a plain forward being the one-row case, so that a
generation gets the same compiled functions and op order alone or batched with others. The rows'
tokens are concatenated along the token axis: everything per token (norms, projections, the MLP,
the LM head) runs once on the concatenation, what depends on a row's caches (RoPE at its offset,
the cache update, attention) per row on its slice. With a matmul that rounds a row the same
whatever the other rows (MLX's CPU reference BLAS), each row gets exactly what it gets alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis

from ..compiled import COMPILED_MAX_TOKENS, entry_point
from ..kernels import DEFAULT_KERNELS, KernelOptions, backend, cpu_extension, cpu_linear
from ..kernels.attention import attention, buffer_mask, single_query
from ..kernels.cpu_head import MIN_PARAMETERS, half_head_for
from ..kernels.matmul import SharedInput, is_gated_mlp, is_sparse_moe, linear, tied_lm_head
from ..rows import RaggedLayout, StackedRows, part, write_rows


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
    # int32 [rows]: each logits row's argmax, from one argmax over a batched forward's rows (lazy:
    # computed only if a row reads it). A greedy row with nothing to apply first takes it instead
    # of slicing, casting and reducing its own logits: a few graph nodes per row, which bound a
    # batch of hundreds of small rows on the host (`engine.choose`). None: not computed.
    choices: Optional[mx.array] = None
    # The row's `ForwardRow.logit_bias` that `choices` were taken after (None: the raw logits').
    choices_bias: Optional[tuple] = None


@dataclass
class ForwardRow:
    """One generation's part of a batched forward (`TargetAdapter.forward_rows`): its tokens
    [1, L] and its own caches, as `forward` takes them."""

    tokens: mx.array
    cache: list
    last_logits_only: bool = False
    record: bool = False
    # A rollback of the row's caches decided since its last forward and applied before this one
    # (record, keep), by whoever runs the forward (`batching.serve`, `step_together`: all rows' at once).
    undo: Optional[tuple[RollbackRecord, int]] = None
    # A greedy row's logit bias (token ids, float32 values, `Sampler.batch_bias`): the batch's one
    # argmax (`TargetOutput.choices`) is then taken after adding it to the row's logits.
    logit_bias: Optional[tuple[Sequence[int], Sequence[float]]] = None


@dataclass
class Rows:
    """The rows of one batched forward as its layers see them (`TargetAdapter.run_rows`)."""

    rows: Sequence[ForwardRow]
    bounds: list[tuple[int, int]]  # where each row's tokens sit in the concatenation
    starts: list[int]  # each row's position before the forward (its caches' offset)
    stacked: Optional[StackedRows] = None  # the rows' KV buffers as the last forward stacked them
    offsets: list[mx.array] = field(init=False)  # the same as arrays, for RoPE: no retracing
    # Per row, what its layers share: masks by buffer length (`cached_attention`).
    masks: list[dict] = field(init=False)
    # Per row, its rollback record (None unless recorded); a family whose caches do not all trim
    # appends each such layer's record to its `states`.
    records: list[Optional[RollbackRecord]] = field(init=False)

    # The rows' attention as one batch (`attend_rows`): the longest row's length, every row's
    # offset as one array, the positions each row writes [rows, 1, longest, 1] (made by the first
    # layer that needs them) and the masks of that layout by buffer length.
    longest: int = field(init=False)
    batch_offsets: mx.array = field(init=False)
    write_positions: Optional[mx.array] = field(init=False, default=None)
    batch_masks: dict = field(init=False)
    layout: RaggedLayout = field(init=False)  # the token axis and the batch of `longest`

    def __post_init__(self):
        self.offsets = [mx.array(s) for s in self.starts]
        self.masks = [{} for _ in self.rows]
        self.records = [RollbackRecord(r.tokens.shape[1]) if r.record else None for r in self.rows]
        self.longest = max(e - s for s, e in self.bounds)
        self.batch_offsets = mx.array(self.starts)
        self.batch_masks = {}
        self.layout = RaggedLayout(self.bounds, self.longest)

    def caches(self, i: int) -> list:
        """Layer `i`'s cache of every row."""
        return [r.cache[i] for r in self.rows]


def join(parts: Sequence[mx.array], axis: int = 1) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=axis)


def heads_first(x: mx.array) -> mx.array:
    """[B, L, heads, D] -> [B, heads, L, D], the layout the caches and attention take."""
    return x.transpose(0, 2, 1, 3)


def rotary(attn):
    """One row's q (and k) [B, L, heads, D] -> [B, heads, L, D] with RoPE at the row's offset (an
    array: offsets do not retrace). The projections stop before RoPE so that they run once for all
    rows; token-major inputs give a row's slice the same layout however many rows there are."""

    def rope(offset, *xs):
        return tuple(attn.rope(heads_first(x), offset=offset) for x in xs)

    return rope


def rotated(pre, attn):
    """One row's projections up to RoPE (`pre`: x -> q, k, ... token-major, or q alone for a layer
    that reuses another's K/V) and RoPE at the row's offset as one block: (x, offset) -> q, k
    [1, heads, L, D] and the rest of `pre`'s outputs as they are. A forward of one row (decode, a
    verify) then builds one compiled block a layer for both, not two: the host's build of a
    forward bounds a small model's cycle. The same ops as `pre` then `rotary`'s, so the same bits
    as rows batched (`attend_rows`)."""
    rope = rotary(attn)

    def block(x, offset):
        q, *kv = pre(x)
        return (*rope(offset, q, *kv[:1]), *kv[1:])

    return block


def attend_row(q, k, v, rows: Rows, caches: Sequence, scale: float, kernels: KernelOptions) -> mx.array:
    """One row's attention from q and k with RoPE [1, heads, L, D] and v token-major: v and k into
    its KVCache (`cached_attention`)."""
    return cached_attention(q, k, heads_first(v), caches[0], scale, rows.starts[0], rows.masks[0], kernels)


def cached_attention(q, k, v, cache, scale: float, start: int, masks: dict, kernels: KernelOptions) -> mx.array:
    """Write k, v into an mlx-lm KVCache and attend. One query (decode): mlx-lm's attention over the
    keys written so far. A block (verify): the cache's whole buffer with its tail masked
    (`buffer_mask`, kept in `masks` by buffer length for the forward's other layers), which on CUDA
    is the block attention."""
    k, v = cache.update_and_fetch(k, v)
    queries = q.shape[2]
    if queries == 1:
        return single_query(q, k, v, cache, scale, None, kernels)
    k, v = cache.keys, cache.values
    length = k.shape[2]
    if length not in masks:
        masks[length] = buffer_mask(length, start, queries)
    return attention(q, [k], [v], scale, masks[length], kernels)


def with_next_input(out, next_norm) -> tuple:
    """A block after attention's output as (h, the next layer's normed input): the block returns both
    where it was given the next layer's input norm (`TargetAdapter.next_input_norm`), else h alone."""
    return out if next_norm is not None else (out, None)


def attend_rows(q, k, v, rows: Rows, caches: Sequence, scale: float, rope, kernels: KernelOptions) -> mx.array:
    """Attention of one layer for every row, q, k, v [1, sum L, heads, D] on the token axis (before
    RoPE), each row's keys written into its KVCache: [1, Hq, sum L, D]. One row: `cached_attention`.
    Several: `batch_keys`, then one attention over all rows (`attend_batch`).
    `rope(offset, q, k)`: `rotary`'s function."""
    if len(rows.rows) == 1:
        return attend_row(*rope(rows.offsets[0], q, k), v, rows, caches, scale, kernels)
    return attend_batch(*batch_keys(q, k, v, rows, caches, rope), rows, scale, kernels)


def batch_keys(q, k, v, rows: Rows, caches: Sequence, rope) -> tuple[mx.array, ...]:
    """Several rows' q, k, v (as `attend_rows` takes them) as one batch [rows, longest, ...] with
    every row's offset in one RoPE, the new keys written into the rows' buffers stacked as one
    [rows, heads, T, D] (`rows.write_rows`; each row's cache then holds its part of that batch):
    the queries [rows, Hq, longest, D], the keys and values up to the last position some row has,
    and the mask [rows, 1, longest, T] that shows each row exactly its own keys, as alone (the
    buffer's extra masked positions only add zeros to its softmax and its product with the values).
    What a layer that reuses another's keys and values (Gemma 4) attends over too."""
    length = rows.longest
    q_b, k_b = rope(rows.batch_offsets, rows.layout.batched(q), rows.layout.batched(k))
    v_b = heads_first(rows.layout.batched(v))
    if rows.write_positions is None:
        positions = rows.batch_offsets[:, None] + mx.arange(length)[None]
        rows.write_positions = positions.reshape(len(rows.rows), 1, length, 1)
    lengths = [e - s for s, e in rows.bounds]
    keys, values = write_rows(caches, rows.starts, lengths, k_b, v_b, rows.write_positions, rows.stacked)
    # Attend over the positions some row has, not the buffers' unused tail (a row's own padding
    # is masked either way).
    size = max(s + n for s, n in zip(rows.starts, lengths))
    if size not in rows.batch_masks:
        rows.batch_masks[size] = mx.arange(size).reshape(1, 1, 1, size) <= rows.write_positions
    return q_b, keys[:, :, :size], values[:, :, :size], rows.batch_masks[size]


def attend_batch(q_b, keys, values, mask, rows: Rows, scale: float, kernels: KernelOptions) -> mx.array:
    """One attention for all rows from `batch_keys` (or a sliding layer's like it), back on the
    token axis: [1, Hq, sum L, D]."""
    out = attention(q_b, [keys], [values], scale, mask, kernels)
    return heads_first(rows.layout.unbatched(heads_first(out)))


def gated_mlp_group(mlp: nn.Module) -> dict[str, list[nn.Module]]:
    """{"gate_up": [gate, up]} for a gated MLP (what `gated_mlp` multiplies by one input) or for the
    shared expert of Qwen3.5's MoE block (`sparse_moe`), {} for others (other MoE blocks)."""
    if is_sparse_moe(mlp):
        mlp = mlp.shared_expert
    return {"gate_up": [mlp.gate_proj, mlp.up_proj]} if is_gated_mlp(mlp) else {}


_UNSET = object()  # a lazily made attribute not made yet


def batch_choices(logits: mx.array, rows: Sequence[ForwardRow], picks: Sequence[tuple[int, int]]) -> mx.array:
    """Each logits position's argmax, int32 [sum of picks]: one reduction for the batch. Rows with a
    logit bias get it added first, as one scatter into float32 logits at their positions and
    tokens (x + b where the row's own sampler adds a dense bias: the same sums; elsewhere x)."""
    x = logits.reshape(-1, logits.shape[-1])
    if any(r.logit_bias is not None for r in rows):
        positions, tokens, values, at = [], [], [], 0
        for r, (s, e) in zip(rows, picks):
            if r.logit_bias is not None:
                ids, biases = r.logit_bias
                for p in range(at, at + e - s):
                    positions += [p] * len(ids)
                    tokens += ids
                    values += biases
            at += e - s
        x = x.astype(mx.float32).at[mx.array(positions), mx.array(tokens)].add(mx.array(values, dtype=mx.float32))
    return mx.argmax(x, axis=-1).astype(mx.int32)


class TargetAdapter:
    family = "base"

    def __init__(self, model: nn.Module, kernels: KernelOptions = DEFAULT_KERNELS):
        self.model = model
        self.kernels = kernels
        self._compiled_fns: dict = {}
        self.stacked_rows = StackedRows()  # batched forwards' KV buffers, for the same rows' next one
        self.compile_max_tokens = COMPILED_MAX_TOKENS  # 0: every forward eager
        self.cpu_head_min_parameters = MIN_PARAMETERS  # a smaller head stays MLX's (kernels/cpu_head.py)
        self._cpu_head: Any = _UNSET  # its HalfHead, made at first use (None: MLX's head)
        # Vision-language checkpoints wrap the text model; only the language model is served.
        self.text_model = getattr(model, "language_model", model)
        self.inner = self.text_model.model
        self.layers = self.inner.layers
        self.narrow_linears = 0  # projections with an int8/float16 copy for our CPU primitive (kernels/cpu_linear.py)
        if kernels.cpu_narrow_linears:
            self.use_narrow_linears()
        if kernels.cpu_softmax and backend() == "cpu":
            cpu_extension.extension()  # built (once, into the cache) at load, not in the first forward
        # Per decoder layer, its groups by name (`layer_groups`), stacked here where that pays.
        self.shared_inputs: list[dict[str, SharedInput]] = [
            {name: SharedInput(group, kernels) for name, group in self.layer_groups(layer).items()}
            for layer in self.layers
        ]

    @property
    def prefill_kernels(self) -> KernelOptions:
        """The options of a prefill (`run_layers`): MLX's float32 product instead of our CPU
        primitive's narrow copies, since a prefill's hundreds of rows are compute-bound, where
        MKL's GEMM is faster (kernels/cpu_linear.py). A prompt is prefilled the same way whether
        the generation then speculates or not, so output stays exactly the target-alone output."""
        return replace(self.kernels, cpu_narrow_linears=False)

    def use_narrow_linears(self, min_parameters: int = cpu_linear.MIN_PARAMETERS) -> int:
        """Give the decoder layers' float32 projections of `min_parameters`+ parameters the int8 or
        float16 copy our CPU primitive multiplies in decode and verify forwards (kernels/cpu_linear.py;
        done at load with the default size, and by tests for tiny models); blocks compiled before
        are traced again."""
        self.narrow_linears += cpu_linear.add_narrow_copies(self.per_token_modules(), min_parameters)
        self._compiled_fns.clear()
        return self.narrow_linears

    def per_token_modules(self) -> list[nn.Module]:
        """The modules whose linear layers a decode or verify forward runs for every token through
        `linear` (the decoder layers; a family adds its own, as Gemma 4's per-layer projection)."""
        return list(self.layers)

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
        if self.tied_head():
            return tied_lm_head(self.inner.embed_tokens, hidden, self.kernels)
        logits = linear(self.text_model.lm_head, hidden, self.kernels)
        group = getattr(self.text_model, "sharding_group", None)  # a head split by vocabulary (distributed.py)
        return logits if group is None else gather_last_axis(logits, group)

    def tied_head(self) -> bool:
        """Whether the embedding is the LM head: the model's own flag where it has one (Gemma 3
        decides at load time whether the checkpoint carries a head), else its config's."""
        tied = getattr(self.text_model, "tie_word_embeddings", None)
        return getattr(self.text_model.args, "tie_word_embeddings", False) if tied is None else tied

    def decode_lm_head(self, hidden: mx.array) -> mx.array:
        """The LM head of decoding, verifying and drafting: `lm_head`, or on the CPU its float16 copy
        in our kernel where that applies (kernels/cpu_head.py), or a smaller float32 head in our
        primitive's fixed order where the BLAS would round it by the row count
        (`cpu_linear.fixed_order_weight`). Not differentiable: training uses `lm_head`."""
        head = self._half_head() if self.kernels.cpu_half_head else None
        if head is not None:
            return head(hidden)
        weight = cpu_linear.fixed_order_weight(self._dense_head_weight()) if self.kernels.cpu_narrow_linears else None
        return cpu_linear.narrow_linear(hidden, weight) if weight is not None else self.lm_head(hidden)

    def head_over(self, token_ids: mx.array):
        """`decode_lm_head` over `token_ids` alone, as a function of the final-normed hidden states
        to logits [..., len(token_ids)], its rows taken now (the caller keeps it): a drafter's draft
        vocabulary (draft_vocab.py). On the CPU a float32 head's rows go through our head kernel
        where they are large enough, as the whole head does; elsewhere `linear`. None where the head
        is not one matrix on this process (split by vocabulary across ranks)."""
        head = self._head_module()
        if head is None:
            return None
        if hasattr(head, "scales"):  # quantized: its rows, still quantized
            weight, scales = head.weight[token_ids], head.scales[token_ids]
            biases = head.biases[token_ids] if "biases" in head else None
            mx.eval(weight, scales, *([] if biases is None else [biases]))
            options = dict(transpose=True, group_size=head.group_size, bits=head.bits,
                           mode=getattr(head, "mode", "affine"))
            return lambda hidden: mx.quantized_matmul(hidden, weight, scales, biases, **options)
        rows = head.weight[token_ids]
        mx.eval(rows)
        kernel = half_head_for(rows, self.cpu_head_min_parameters) if self.kernels.cpu_half_head else None
        if kernel is not None:
            return kernel
        layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        layer.weight = rows
        return lambda hidden: linear(layer, hidden, self.kernels)

    def _half_head(self):
        if self._cpu_head is _UNSET:
            weight = self._dense_head_weight()
            self._cpu_head = None if weight is None else half_head_for(weight, self.cpu_head_min_parameters)
        return self._cpu_head

    def _dense_head_weight(self) -> Optional[mx.array]:
        """The head's [vocab, hidden] weight where it is one plain matrix on this process, else None."""
        head = self._head_module()
        if head is None or hasattr(head, "scales") or "weight" not in head:
            return None
        return head.weight

    def _head_module(self) -> Optional[nn.Module]:
        """The module whose weight is the LM head (the embedding where tied), where it is one matrix
        on this process (not split by vocabulary across ranks) without a bias, else None."""
        head = self.inner.embed_tokens if self.tied_head() else getattr(self.text_model, "lm_head", None)
        if head is None or "bias" in head or getattr(self.text_model, "sharding_group", None) is not None:
            return None
        return head

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm and LM head as the mlx-lm model computes them (the head on the CPU: `decode_lm_head`)."""
        return self.decode_lm_head(self.inner.norm(hidden))

    def compiled(self, key, make):
        """mx.compile(make()) once per key and kernel options (traced again only for new input
        shapes): `make` builds its block for this adapter's options, which it reads when traced."""
        key = (self.kernels, key)
        entry = self._compiled_fns.get(key)
        if entry is None:
            block = make()
            entry = self._compiled_fns[key] = (mx.compile(entry_point(block)), block)
        return entry[0]

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
        (recorded forwards only) gets what rolling back a layer that cannot be trimmed needs.
        Families with `run_rows` get here only for forwards not in rows (prefill)."""
        raise NotImplementedError

    def run_rows(self, tokens: mx.array, rows: Rows, tap_ids: Sequence[int]):
        """`run_layers` for rows: `tokens` [1, sum L] are the rows' tokens one after another;
        returns (last hidden, {layer id: output}) over all of them. A layer whose cache does not
        trim records what its rollback needs in `rows.records` (Qwen3.5's GatedDeltaNet)."""
        raise NotImplementedError

    def position(self, cache: list) -> int:
        """The number of tokens a generation's caches hold (every layer's cache has the same)."""
        return cache[0].offset

    def in_rows(self, tokens: mx.array) -> bool:
        """Whether a forward of `tokens` runs as a row of `run_rows`: decode and verify, in the
        families that have it."""
        return (type(self).run_rows is not TargetAdapter.run_rows and tokens.shape[0] == 1
                and tokens.shape[1] <= self.compile_max_tokens)

    def forward(
        self,
        tokens: mx.array,
        cache: list,
        tap_ids: Sequence[int] = (),
        *,
        last_logits_only: bool = False,
        record: bool = False,
    ) -> TargetOutput:
        row = ForwardRow(tokens, cache, last_logits_only, record)
        if self.in_rows(tokens):  # the one-row case: the same functions as with other rows
            return self.forward_rows([row], tap_ids)[0]
        return self.forward_alone(row, tap_ids)

    def forward_alone(self, row: ForwardRow, tap_ids: Sequence[int] = ()) -> TargetOutput:
        """A forward through `run_layers` (prefill, and every forward of families without rows)."""
        rollback = RollbackRecord(row.tokens.shape[1]) if row.record else None
        h, tapped = self.run_layers(row.tokens, row.cache, tap_ids, rollback.states if row.record else None)
        if row.last_logits_only:
            h = h[:, -1:]
        tapped_hidden = mx.concatenate([tapped[i] for i in tap_ids], axis=-1) if tap_ids else None
        return TargetOutput(self.logits(h), tapped_hidden, rollback)

    def forward_rows(self, rows: Sequence[ForwardRow], tap_ids: Sequence[int] = ()) -> list[TargetOutput]:
        """One forward for several generations (continuous batching): each row's output, and what
        it does to the row's caches, is exactly what `forward` gives that row alone, while the
        weights are read once for all rows. Rows `in_rows` run together through `run_rows`; the
        others (prefill, or every row where the family has no `run_rows`) one after another.
        Every row must have caches of its own."""
        outputs: list[Optional[TargetOutput]] = [None] * len(rows)
        together = [i for i, r in enumerate(rows) if self.in_rows(r.tokens)]
        for i, r in enumerate(rows):
            if i not in together:
                outputs[i] = self.forward_alone(r, tap_ids)
        if together:
            for i, out in zip(together, self._forward_together([rows[i] for i in together], tap_ids)):
                outputs[i] = out
        return outputs

    def _forward_together(self, rows: Sequence[ForwardRow], tap_ids: Sequence[int]) -> list[TargetOutput]:
        bounds, end = [], 0
        for r in rows:
            bounds.append((end, end + r.tokens.shape[1]))
            end += r.tokens.shape[1]
        state = Rows(rows, bounds, [self.position(r.cache) for r in rows], self.stacked_rows)
        try:
            h, tapped = self.run_rows(join([r.tokens for r in rows]), state, tap_ids)
        finally:
            if len(rows) > 1:  # (a row alone stacks nothing)
                self.stacked_rows.end_forward()
        # The LM head once, over the positions each row wants.
        picks = [(e - 1, e) if r.last_logits_only else (s, e) for r, (s, e) in zip(rows, bounds)]
        # (Where every row wants all its positions, as in decode steps and verifies, that is h itself.)
        logits = self.logits(h if picks == bounds else join([part(h, s, e) for s, e in picks]))
        choices = batch_choices(logits, rows, picks)  # (lazy, see TargetOutput)
        # The tapped layers side by side once for all rows; each row then takes its tokens' part.
        taps = join([tapped[i] for i in tap_ids], axis=-1) if tap_ids else None
        outputs, at = [], 0
        for (s, e), (ps, pe), record in zip(bounds, picks, state.records):
            n = pe - ps
            outputs.append(TargetOutput(part(logits, at, at + n), part(taps, s, e) if taps is not None else None, record,
                                        part(choices, at, at + n, axis=0), r.logit_bias))
            at += n
        return outputs

    def next_input_norm(self, i: int):
        """Layer i+1's input norm, which layer i's block applies with its last residual add (one
        launch where kernels/norms.py has it); None after the last layer."""
        return self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None

    def queue_layers(self, i: int, h: mx.array, rows: Rows) -> None:
        """Start the device on the layers built so far, a quarter of the stack at a time, in a
        forward that verifies (a row of more than one token). MLX runs nothing until asked, so the
        device would otherwise wait for the host to build and launch the whole verify; now it works
        through the first layers while the host does the rest. Plain decode steps keep one launch
        point: the engine queues the next one before reading this one, so the device is busy
        anyway, and there the extra points cost more than they gave (benchmarks/gpu_batch.py
        --unqueued, docs/performance.md). The graph and its results are unchanged."""
        every = max(1, len(self.layers) // 4)
        if self.kernels.queue_layers and rows.longest > 1 and (i + 1) % every == 0 and i + 1 < len(self.layers):
            mx.async_eval(h)

    def rollback_rows(self, undos: Sequence[tuple[list, RollbackRecord, int]]) -> None:
        """`rollback(cache, record, keep)` for each (cache, record, keep): several generations'
        rollbacks before their next batched forward (a family may do them in fewer ops)."""
        for cache, record, keep in undos:
            self.rollback(cache, record, keep)

    def rollback(self, cache: list, record: RollbackRecord, keep: int) -> None:
        """Undo all but the first `keep` tokens of the recorded forward."""
        for c in cache:
            if c is not None and record.tokens > keep:
                c.trim(record.tokens - keep)
