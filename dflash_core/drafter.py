"""The DFlash drafter: a few Qwen3-style layers conditioned on hidden states tapped from the target.

It has no embedding table and no LM head of its own: the target lends both (see the adapters).
Each layer projects the target's context vectors with its own k/v projections (cached across
cycles, never rolled back because only committed positions are ever added) and lets one block of
`[bonus, MASK * (B-1)]` queries attend over `[context K/V ; block K/V]`. One forward pass proposes
B-1 tokens (argmax of each row: one denoising step).

Several generations draft in one forward (`propose_rows`, `add_context_rows`): their blocks are
concatenated along the token axis for the per-token work; RoPE and attention run on them as one
batch over their contexts stacked (`BlockBatch`, rows.py). Where a product's rows are independent
(the CPU's reference BLAS) a row's drafts are exactly what it gets alone.

Checkpoint format and config layouts: docs/formats.md (z-lab `DFlashDraftModel`); its config.json is
read and checked in drafter_config.py.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .cache import RowsKVCache
from .compiled import COMPILED_MAX_TOKENS, BlockCache
from .draft_vocab import read_draft_vocab, uses_draft_vocab
from .drafter_config import CheckpointError, DrafterConfig, HeldOutAcceptance, read_held_out_acceptance
from .kernels import DEFAULT_KERNELS, KernelOptions, backend
from .kernels.attention import attention, joins_for_exact
from .kernels.matmul import SharedInput, gated_mlp, linear, linears
from .kernels.norms import add_norm, norm_of
from .rows import RaggedLayout, StackedRows, stack_buffers, write_rows

log = logging.getLogger(__name__)

class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        self.kv_input: Optional[SharedInput] = None  # k and v, once stacked (DFlashDrafter.stack_shared_inputs)

    def _queries(self, x: mx.array, kernels: KernelOptions) -> mx.array:
        """Q (normed) of `x` as [B, L, Hq, D], before RoPE."""
        B, L, _ = x.shape
        return self.q_norm(linear(self.q_proj, x, kernels).reshape(B, L, self.n_heads, -1))

    def _token_keys_values(self, x: mx.array, kernels: KernelOptions) -> tuple[mx.array, mx.array]:
        """K (normed) and V of `x` as [B, L, Hkv, D], before RoPE."""
        B, L, _ = x.shape
        kv = self.kv_input if self.kv_input is not None else [self.k_proj, self.v_proj]
        k, v = linears(kv, x, kernels)
        return self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)), v.reshape(B, L, self.n_kv_heads, -1)

    def unrotated_keys_values(self, x: mx.array, kernels: KernelOptions = DEFAULT_KERNELS):
        """K (normed) and V of `x` as [B, Hkv, L, D], before RoPE: per token, so for several rows at once."""
        k, v = self._token_keys_values(x, kernels)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, offset, kernels: KernelOptions = DEFAULT_KERNELS):
        """K/V of `x` at absolute positions offset.. (input_layernorm is not applied to context)."""
        k, v = self.unrotated_keys_values(x, kernels)
        return self.rope(k, offset=offset), v

    def projections(self, x: mx.array, kernels: KernelOptions) -> tuple[mx.array, mx.array, mx.array]:
        """q, k (normed) and v of `x` as [B, L, heads, D], before RoPE: per token, so for several
        blocks at once."""
        return (self._queries(x, kernels), *self._token_keys_values(x, kernels))

    def rotated(self, q, k, v, start) -> tuple[mx.array, mx.array, mx.array]:
        """One block's `projections` heads first [B, heads, L, D], q and k with RoPE from position
        `start` (an int, or an array on the device)."""
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        return self.rope(q, offset=start), self.rope(k, offset=start), v

    def attend_rotated(self, q, k, v, context: tuple[mx.array, mx.array], mask, kernels: KernelOptions) -> mx.array:
        """Attention of one block's `rotated` q, k, v over [context ; block]: [B, L, Hq * D], before
        o_proj."""
        B, L = q.shape[0], q.shape[2]
        out = attention(q, *_key_segments(q, context, k, v, mask, kernels), self.scale, mask, kernels)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)

    def attend(self, q, k, v, context: tuple[mx.array, mx.array], start, mask, kernels: KernelOptions) -> mx.array:
        """RoPE and attention of one block whose first query sits at `start`, over [context ;
        block], from its `projections`: [B, L, Hq * D], before o_proj."""
        return self.attend_rotated(*self.rotated(q, k, v, start), context, mask, kernels)

    def attend_batch(self, q, k, v, batch: "BlockBatch", context: tuple[mx.array, mx.array], mask: mx.array,
                     kernels: KernelOptions) -> mx.array:
        """`attend` for several rows' blocks, concatenated along the token axis, as one batch: RoPE
        at every row's offset in one op, one attention over the rows' contexts stacked [rows, Hkv,
        T, D] and their blocks."""
        B, L = q.shape[:2]
        q, k, v = (batch.layout.batched(a).transpose(0, 2, 1, 3) for a in (q, k, v))
        q, k = self.rope(q, offset=batch.offsets), self.rope(k, offset=batch.offsets)
        out = attention(q, *_key_segments(q, context, k, v, mask, kernels), self.scale, mask, kernels)
        return batch.layout.unbatched(out.transpose(0, 2, 1, 3)).reshape(B, L, -1)

    def __call__(self, x, context: tuple[mx.array, mx.array], start, mask,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
        """Attention of one block whose first query sits at `start`, over [context ; block]."""
        return linear(self.o_proj, self.attend(*self.projections(x, kernels), context, start, mask, kernels), kernels)


def _key_segments(q: mx.array, context: tuple[mx.array, mx.array], k: mx.array, v: mx.array, mask,
                  kernels: KernelOptions) -> tuple[list[mx.array], list[mx.array]]:
    """A block's keys and values over [context ; block]: two segments, or one joined where the
    exact kernel would take them so and the context is small enough to copy
    (`kernels.attention.joins_for_exact`, `KernelOptions.drafter_exact_attention`)."""
    keys, values = [context[0], k], [context[1], v]
    if joins_for_exact(q, keys, values, mask, kernels):
        return [mx.concatenate(keys, axis=2)], [mx.concatenate(values, axis=2)]
    return keys, values


class BlockBatch:
    """The blocks of several generations as one batch (`DFlashDrafter.hidden_rows`): where each
    row's tokens sit, the widest block, every row's first position, and per layer its contexts
    stacked and the mask of what each query sees of [context ; block]."""

    def __init__(self, widths: Sequence[int], starts: Sequence[int]):
        ends = list(itertools.accumulate(widths))
        self.bounds = [(e - w, e) for w, e in zip(widths, ends)]
        self.width = max(widths)
        self.offsets = mx.array(list(starts))
        self._widths = mx.array(list(widths))
        self._masks: dict = {}
        self.layout = RaggedLayout(self.bounds, self.width)

    def context(self, caches: Sequence[KVCache], attn: "DrafterAttention", dtype,
                stacked: Optional[StackedRows] = None) -> tuple[mx.array, mx.array]:
        """The rows' context buffers stacked [rows, heads, T, D]: as their last batched write left
        them (`stacked`), else each row's padded to the longest."""
        last = stacked.take(caches) if stacked is not None else None
        if last is not None:
            stacked.keep(caches, last)  # read, not written: the next block of these rows reads it again
            return last
        size = max([c.keys.shape[2] for c in caches if c.keys is not None] + [0])
        like = mx.zeros((1, attn.n_kv_heads, 0, attn.head_dim), dtype)
        return (stack_buffers([c.keys for c in caches], size, like), stack_buffers([c.values for c in caches], size, like))

    def mask(self, cfg: "DrafterConfig", layer: int, size: int) -> mx.array:
        """[rows, 1, width, size + width]: a row's queries see its context (positions before its
        start) and its own block's keys (causal, windowed, as the layer is), never padding."""
        key = (cfg.is_causal(layer), cfg.is_sliding(layer), size)
        if key not in self._masks:
            starts = self.offsets.reshape(-1, 1, 1, 1)
            q_pos = starts + mx.arange(self.width).reshape(1, 1, -1, 1)
            ctx_pos = mx.arange(size).reshape(1, 1, 1, -1)
            block = mx.arange(self.width).reshape(1, 1, 1, -1)
            sees_ctx = ctx_pos < starts
            sees_block = block < self._widths.reshape(-1, 1, 1, 1)
            if cfg.is_causal(layer):
                sees_block = sees_block & (block <= mx.arange(self.width).reshape(1, 1, -1, 1))
            if cfg.is_sliding(layer):
                sees_ctx = sees_ctx & (q_pos - ctx_pos < cfg.sliding_window)
                sees_block = sees_block & (mx.abs(q_pos - (starts + block)) < cfg.sliding_window)
            self._masks[key] = mx.concatenate([mx.broadcast_to(sees_ctx, (*q_pos.shape[:3], size)),
                                               mx.broadcast_to(sees_block, (*q_pos.shape[:3], self.width))], axis=-1)
        return self._masks[key]


class BlockRow(NamedTuple):
    """One block's view of a layer: its context (K, V), first query's position, mask over [context ; block]."""

    context: tuple[mx.array, mx.array]
    start: Any
    mask: Any


@dataclass
class DraftRow:
    """One generation in `DFlashDrafter.propose_rows`: its bonus token (one id, may be lazy), cache and block width."""

    bonus: mx.array
    cache: list
    width: int


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.gate_up_input: Optional[SharedInput] = None  # the MLP's gate and up, once stacked
        self.compiled = BlockCache()  # the blocks of `forward` and `context_keys_values`

    def __call__(self, h, context, start, mask, kernels: KernelOptions = DEFAULT_KERNELS):
        """The layer op by op (what training differentiates)."""
        return self._mlp(h, self.self_attn(self.input_layernorm(h), context, start, mask, kernels), kernels)

    def forward(self, h, attend, kernels: KernelOptions, start: Optional[mx.array] = None):
        """The layer's output for the engine's drafts, `attend(q, k, v)` being the block's (or
        blocks') attention: what comes before it (input norm, projections, their norms, and with
        `start` given, one block's RoPE from that position) and after it (o_proj, residuals, the
        MLP) run as two compiled blocks, each built as a graph in one call where op by op they
        were some thirty (a small target's cycle waits on the host that builds its graphs); blocks
        of more than COMPILED_MAX_TOKENS tokens (several rows') op by op. `attend`: with `start`,
        `DrafterAttention.attend_rotated`'s; without, `attend_batch`'s (RoPE at each row's start)."""
        args = (h,) if start is None else (h, start)
        if not kernels.compiled_drafter or h.shape[1] > COMPILED_MAX_TOKENS:
            return self._post(kernels)(h, attend(*self._pre(kernels, start is not None)(*args)))
        pre = self.compiled.get(self, ("pre", start is not None, kernels), lambda: self._pre(kernels, start is not None))
        post = self.compiled.get(self, ("post", kernels), lambda: self._post(kernels))
        return post(h, attend(*pre(*args)))

    def context_keys_values(self, c: mx.array, kernels: KernelOptions) -> tuple[mx.array, mx.array]:
        """`DrafterAttention.unrotated_keys_values` of the context vectors `c`, a compiled block
        where `forward`'s are."""
        if not kernels.compiled_drafter or c.shape[1] > COMPILED_MAX_TOKENS:
            return self.self_attn.unrotated_keys_values(c, kernels)
        return self.compiled.get(self, ("context", kernels), lambda: partial(self.self_attn.unrotated_keys_values,
                                                                            kernels=kernels))(c)

    def _pre(self, kernels: KernelOptions, rotate: bool):
        attn = self.self_attn
        if rotate:
            return lambda h, start: attn.rotated(*attn.projections(self.input_layernorm(h), kernels), start)
        return lambda h: attn.projections(self.input_layernorm(h), kernels)

    def _post(self, kernels: KernelOptions):
        return lambda h, attended: self._mlp(h, linear(self.self_attn.o_proj, attended, kernels), kernels)

    def _mlp(self, h, attended, kernels: KernelOptions):
        h, x = add_norm(h, attended, *norm_of(self.post_attention_layernorm), kernels)
        return h + gated_mlp(self.mlp, x, swiglu, kernels, self.gate_up_input)


class DFlashDrafter(nn.Module):
    """Weights named exactly as z-lab's checkpoints (fc, hidden_norm, layers.N..., norm). Its
    forwards run with `kernels` (not a parameter: an attribute of the object)."""

    def __init__(self, cfg: DrafterConfig, kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        n_taps = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.stacked_rows = StackedRows()  # the batched rows' context buffers, for their next block
        # Its training report's held-out acceptance by block position (`load_drafter`), if it has one:
        # what `speculation: auto` expects of it before its own cycles say more.
        self.held_out_acceptance: Optional[HeldOutAcceptance] = None
        # The token ids its drafts are chosen among (`load_drafter`: draft_vocab.json), None: all.
        self.draft_vocab: Optional[mx.array] = None
        self._head_over: Optional[tuple[Any, Any, Any]] = None  # (target, draft_vocab, that head over it)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def drafts_ahead(self) -> bool:
        """Whether the engine may queue this drafter's blocks before it knows where they start
        (`propose(start=...)`, `KernelOptions.draft_ahead`)."""
        if self.kernels.draft_ahead is None:
            return backend() != "cpu"
        return self.kernels.draft_ahead

    def make_cache(self) -> list[KVCache]:
        return [RowsKVCache() for _ in self.layers]

    def with_kernels(self, kernels: KernelOptions) -> "DFlashDrafter":
        """This drafter, same layers and weights (as stacked), with other kernel options."""
        other = copy.copy(self)
        other.kernels = kernels
        return other

    def stack_shared_inputs(self) -> None:
        """On CUDA, one matrix for each layer's k and v (the block and the context both multiply
        them by one input) and for its MLP's gate and up (a `SharedInput`, kernels/matmul.py). Call
        it once the weights are loaded: new weights put in later (training) drop their stack by
        themselves."""
        for layer in self.layers:
            layer.self_attn.kv_input = SharedInput([layer.self_attn.k_proj, layer.self_attn.v_proj], self.kernels)
            layer.gate_up_input = SharedInput([layer.mlp.gate_proj, layer.mlp.up_proj], self.kernels)

    def add_context(self, taps: mx.array, cache: list[KVCache]) -> None:
        """Project target taps [1, n, n_taps*H] of the next n positions into every layer's context
        K/V. Positions are implied: they continue from what the cache already holds."""
        self.add_context_rows([(taps, cache)])

    def add_context_rows(self, rows: Sequence[tuple[mx.array, list[KVCache]]]) -> None:
        """`add_context(taps, cache)` for each row, with fc, hidden_norm and the k/v projections run
        once over all rows' positions, RoPE and the cache writes for all rows at once."""
        widths = [taps.shape[1] for taps, _ in rows]
        # A cycle's few taps through `linear`, as the layers' products: on CUDA the stream kernel
        # (it was the cycle's one cuBLASLt call), on the CPU the fixed-order product, both rounding
        # a row alike whatever rows share the call. A prompt's many stay MLX's GEMM: on the CPU the
        # fast BLAS is 3-5x faster than the fixed-order product at hundreds of rows
        # (benchmarks/drafter_fc.py).
        joined = _concat([taps for taps, _ in rows], axis=1)
        few = joined.shape[1] <= COMPILED_MAX_TOKENS
        c = self.hidden_norm(linear(self.fc, joined, self.kernels) if few else self.fc(joined))
        if len(rows) > 1:  # the writes for all rows at once, into their buffers stacked
            bounds = [(e - w, e) for w, e in zip(widths, itertools.accumulate(widths))]
            starts = [cache[0].offset for _, cache in rows]
            offsets = mx.array(starts)
            layout = RaggedLayout(bounds, max(widths))  # (its gather made once for all layers)
        for i, layer in enumerate(self.layers):
            k, v = layer.context_keys_values(c, self.kernels)
            if len(rows) == 1:
                cache = rows[0][1][i]
                cache.update_and_fetch(layer.self_attn.rope(k, offset=cache.offset), v)
                continue
            k, v = (layout.batched(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for a in (k, v))
            write_rows([cache[i] for _, cache in rows], starts, widths, layer.self_attn.rope(k, offset=offsets), v,
                       stacked=self.stacked_rows)
        if len(rows) > 1:
            self.stacked_rows.end_forward()

    def _block_row(self, layer: int, cache: KVCache, start, block: int, masks: dict,
                   earliest: Optional[int] = None) -> BlockRow:
        """A block's row of one layer: its context buffer and the boolean mask of what each block
        query sees of [context buffer ; block]. `masks` keeps the masks made in this forward: layers
        alike share one (a drafter's layers are mostly alike, and each mask is several launches).
        `start` may be an array on the device (a block drafted ahead, `propose(start=...)`), with
        `earliest` the least it can be.

        The context is the cache's whole buffer (it grows in steps of 256) with the unused tail
        masked, so attention shapes change once per 256 positions rather than every cycle: on CUDA,
        MLX builds a cuDNN graph per shape, which costs far more than the attention itself."""
        cfg = self.config
        if cache.keys is None:
            ctx = _empty_context(self.layers[layer].self_attn, self.fc.weight.dtype)
        else:
            ctx = (cache.keys, cache.values)
        first_key = 0
        if cfg.is_sliding(layer):
            # Keys older than the first query's window can never be seen: do not even read them
            # (cut at a multiple of 256, for the same shape reuse).
            first_key = max(0, (start if earliest is None else earliest) - cfg.sliding_window + 1) // 256 * 256
            ctx = (ctx[0][..., first_key:, :], ctx[1][..., first_key:, :])
        n_ctx = ctx[0].shape[2]
        key = (cfg.is_causal(layer), cfg.is_sliding(layer), first_key, n_ctx)
        if key not in masks:
            block_pos = mx.arange(block) + start if isinstance(start, mx.array) else mx.arange(start, start + block)
            q_pos = block_pos[:, None]
            ctx_pos = mx.arange(first_key, first_key + n_ctx)
            k_pos = mx.concatenate([mx.where(ctx_pos < start, ctx_pos, -(1 << 30)), block_pos])[None]
            mask = k_pos > -(1 << 30)
            if cfg.is_causal(layer):
                mask = mask & (k_pos <= q_pos)
            if cfg.is_sliding(layer):
                mask = mask & (mx.abs(q_pos - k_pos) < cfg.sliding_window)
            masks[key] = mask
        return BlockRow(ctx, start, masks[key])

    def hidden(self, embeddings: mx.array, cache: list[KVCache]) -> mx.array:
        """Final-normed hidden states of a block whose first row sits at the cache's offset."""
        return self.hidden_rows(embeddings, [cache], [embeddings.shape[1]])

    def hidden_rows(self, embeddings: mx.array, caches: Sequence[list[KVCache]], widths: Sequence[int],
                    start: Optional[tuple[mx.array, int]] = None) -> mx.array:
        """`hidden` of several blocks concatenated along the token axis, each at its own cache's
        offset; one block may instead start at `start` = (a position on the device before the
        cache's offset, the least it can be) (`propose`)."""
        starts = [cache[0].offset for cache in caches]
        h = embeddings * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeddings
        if len(caches) == 1:
            masks: dict = {}
            first, earliest = (starts[0], None) if start is None else start
            # RoPE's offset an array, one for every layer: an input of their compiled blocks (an int
            # would be a constant of the trace, traced again at every position).
            offset = first if isinstance(first, mx.array) else mx.array(first, mx.int32)
            for i, layer in enumerate(self.layers):
                row = self._block_row(i, caches[0][i], first, widths[0], masks, earliest)
                attend = partial(layer.self_attn.attend_rotated, context=row.context, mask=row.mask,
                                 kernels=self.kernels)
                h = layer.forward(h, attend, self.kernels, offset)
            return self.norm(h)
        if start is not None:
            raise ValueError("a block drafted at a position on the device is drafted alone")
        # Several rows: each layer's attention for all of them at once over their stacked contexts
        # (the masks hide each row's padding and the stale tail of its buffer).
        batch = BlockBatch(widths, starts)
        used = max(starts)  # no row sees a context position past its own start
        for i, layer in enumerate(self.layers):
            context = batch.context([cache[i] for cache in caches], layer.self_attn, h.dtype, self.stacked_rows)
            if used < context[0].shape[2]:
                # Attend over the positions some row has, not the buffers' unused tail (masked for
                # every row, it only adds exp(-inf) terms: a softmax's exps are most of a small
                # attention's time on a CPU).
                context = (context[0][:, :, :used], context[1][:, :, :used])
            mask = batch.mask(self.config, i, context[0].shape[2])
            attend = partial(layer.self_attn.attend_batch, batch=batch, context=context, mask=mask, kernels=self.kernels)
            h = layer.forward(h, attend, self.kernels)
        self.stacked_rows.end_forward()
        return self.norm(h)

    def logits(self, hidden: mx.array, lm_head) -> mx.array:
        cfg = self.config
        out = lm_head(hidden)
        if cfg.output_multiplier != 1.0:
            out = out * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            out = mx.tanh(out / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return out

    def propose(self, bonus: mx.array, target, cache: list[KVCache], width: Optional[int] = None,
                start: Optional[tuple[mx.array, int]] = None) -> mx.array:
        """width-1 proposals (int32) for the positions after `bonus` (default: the block size's),
        the first of one forward pass over the whole block (`propose_rows`). The block starts at the cache's offset, or at
        `start` = (position on the device, the least it can be): a block drafted before the host
        knows where it starts (the engine's drafts ahead), whose context holds positions past it
        that its queries must not see."""
        return self.propose_rows([DraftRow(bonus, cache, width or self.config.block_size)], target, start)[0]

    def propose_rows(self, rows: Sequence[DraftRow], target,
                     start: Optional[tuple[mx.array, int]] = None) -> list[mx.array]:
        """`propose` for each row (width-1 proposals each), in one forward over all their blocks.
        Every block is drafted whole, whatever width its cycle verifies: the drafter was trained on
        whole blocks, and a block's positions attend to one another, so a narrower block of masks
        drafts worse, not only fewer (the demo pair's held-out code prompts, always 8 wide: 1.94-4.74
        tokens a cycle where the whole block's first 7 drafts would have made 2.42-6.53;
        benchmarks/auto_widths.py, docs/performance.md). Only the drafts a row verifies go through
        the LM head."""
        mask_id, size, widths = self.config.mask_token_id, self.config.block_size, [row.width for row in rows]
        if any(not 2 <= w <= size for w in widths):
            raise ValueError(f"a draft's width (its bonus token and drafts) is 2 to the block size {size}, not {widths}")
        blocks = [size] * len(rows)
        block = _concat([mx.concatenate([row.bonus.reshape(1).astype(mx.int32),
                                         mx.full((size - 1,), mask_id, mx.int32)]) for row in rows])
        h = self.hidden_rows(target.embed(block[None]), [row.cache for row in rows], blocks, start)
        # The bonus position predicts nothing: only the drafts verified go through the LM head.
        h = _concat([h_i[:, 1:w] for h_i, w in zip(_split(h, blocks, axis=1), widths)], axis=1)
        head, ids = self._draft_head(target)
        drafts = mx.argmax(self.logits(h, head), axis=-1)[0].astype(mx.int32)
        if ids is not None:
            drafts = ids[drafts]
        return _split(drafts, [w - 1 for w in widths], axis=0)

    def _draft_head(self, target):
        """The LM head drafts are chosen by, and the ids its columns stand for (None: the head's
        own, the whole vocabulary): over `draft_vocab` where the drafter has one, its kernel options
        use it (`KernelOptions.draft_vocab`) and the target can cut its head (`head_over`), made once
        per target and vocabulary."""
        whole = getattr(target, "decode_lm_head", target.lm_head)
        if self.draft_vocab is None or not uses_draft_vocab(self.kernels):
            return whole, None
        if self._head_over is None or self._head_over[0] is not target or self._head_over[1] is not self.draft_vocab:
            over = getattr(target, "head_over", None)
            self._head_over = (target, self.draft_vocab, over(self.draft_vocab) if over is not None else None)
        head = self._head_over[2]
        return (whole, None) if head is None else (head, self.draft_vocab)


def _split(a: mx.array, widths: Sequence[int], axis: int) -> list[mx.array]:
    """`a` cut along `axis` into consecutive pieces of `widths` (one row: `a` itself)."""
    if len(widths) == 1:
        return [a]
    return mx.split(a, list(itertools.accumulate(widths[:-1])), axis=axis)


def _concat(parts: Sequence[mx.array], axis: int = 0) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=axis)


def _empty_context(attn: "DrafterAttention", dtype) -> tuple[mx.array, mx.array]:
    empty = mx.zeros((1, attn.n_kv_heads, 0, attn.head_dim), dtype=dtype)
    return empty, empty


def read_drafter_config(path: Path) -> tuple[dict, DrafterConfig]:
    """A drafter directory's config.json: as written, and parsed (errors name the file and key)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file}: file not found (is {path} a DFlash drafter directory?)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from e
    return raw, DrafterConfig.from_dict(raw, source=str(config_file))


def load_drafter(path: str | Path, *, dtype: Optional[mx.Dtype] = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> DFlashDrafter:
    """Load a z-lab DFlash checkpoint directory (config.json + *.safetensors), strictly."""
    path = Path(path)
    _, cfg = read_drafter_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = _sanitize(weights, source=str(path))
    model = DFlashDrafter(cfg, kernels)
    expected = {k for k, _ in _flat_parameters(model)}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the DFlash drafter config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    model.stack_shared_inputs()
    model.held_out_acceptance = read_held_out_acceptance(path, cfg.block_size - 1)
    model.draft_vocab = read_draft_vocab(path, cfg.vocab_size)
    return model


def _sanitize(weights: dict[str, mx.array], source: str) -> dict[str, mx.array]:
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key.startswith(("embed_tokens.", "lm_head.")):
            # The drafter borrows the target's; a stray copy in the checkpoint is ignored.
            log.warning("%s: ignoring %s (the drafter uses the target's embedding and LM head)", source, key)
            continue
        out[key] = value
    return out


def _flat_parameters(model: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
