"""Gemma 3 text models (the offline demo's Gemma 3 270M among them).

Every `sliding_window_pattern`-th layer is global, the others attend within a sliding window; the
embedding is scaled by sqrt(H) rounded to bfloat16 (as the model was trained), the drafter gets it
unscaled. Sliding layers use `SlidingWindowCache`: mlx-lm's RotatingKVCache cannot be trimmed once
it has wrapped. Prefill runs mlx-lm's layers' modules in their order (`block`); decode and verify run
as rows (`TargetAdapter.run_rows`), each layer as compiled functions for all rows around RoPE, the
cache update and attention (on a CPU, eager small ops cost a 270M model's decode step a fifth of
its time). Several rows attend as one batch in every layer: the global layers over their KV
buffers (`attend_rows`), the sliding ones over their rings stacked (`attend_window_rows`); row by
row, 15 of the 270M's 18 layers made a step of 128 rows cost about 128 one-row steps of host work.
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..cache import RowsKVCache, SlidingWindowCache, ring_mask
from ..kernels import DEFAULT_KERNELS, KernelOptions, backend
from ..kernels.attention import attention, single_query
from ..kernels.matmul import gated_mlp, linear
from ..kernels.norms import add_norm, add_normed
from ..rows import ring_slots, write_ring_rows
from .base import (
    Rows,
    TargetAdapter,
    attend_batch,
    attend_row,
    attend_rows,
    gated_mlp_group,
    heads_first,
    join,
    part,
    rotary,
    rotated,
    with_next_input,
)
from .dense import attention_inputs, prefill_attention  # Gemma 3's attention up to RoPE is Qwen3's (per-head norms)

# tanh(x) ~ x P(x^2) / Q(x^2) for |x| <= 9 (beyond, float32's tanh is +-1): a rational least-squares
# fit made for this file. Largest error against float64 tanh: 3.5e-7 in float32 arithmetic, under
# one float32 ulp in float64. MLX's CPU backend computes `tanh` with a scalar library call per value,
# most of the time of Gemma 3's GELU in a prefill (docs/performance.md, "The CPU path"); adds,
# multiplies and one division fused by mx.compile are what it runs fastest. The CPU's alone: on a
# GPU the tanh is one instruction and this chain is several kernels (`gelu_approx_gate`).
TANH_P = (0.9999999832, 0.1339243432, 0.003509136221, 2.083198071e-05, 1.366345839e-08)
TANH_Q = (1.0, 0.4672575296, 0.02592852808, 0.0003307789092, 7.902955802e-07)
TANH_LIMIT = 9.0


def _poly(coefficients, s: mx.array) -> mx.array:
    out = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        out = out * s + c
    return out


def rational_tanh(x: mx.array) -> mx.array:
    x = mx.clip(x, -TANH_LIMIT, TANH_LIMIT)
    s = x * x
    return x * _poly(TANH_P, s) / _poly(TANH_Q, s)


@partial(mx.compile, shapeless=True)
def gelu_rational_gate(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's `gelu_approx(gate) * up` (the tanh approximation of GELU) with `rational_tanh` for
    the tanh."""
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (1 + rational_tanh(inner)) * up


def gelu_tanh_gate(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's `gelu_approx(gate) * up` itself, not compiled again around it: in the compiled
    blocks of decode and verify it is one fused kernel with the product (compiled shapeless, as
    the rational form is, its constants' broadcasts would count toward the depth limit and split
    it in two); in a prefill MLX's own compiled GELU and the product, the same bits (MLX's fused
    kernels round each op as its own kernel does)."""
    return nn.gelu_approx(gate) * up


def gelu_approx_gate(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma 3's MLP activation, mlx-lm's `gelu_approx(gate) * up`: on the CPU with `rational_tanh`
    (`gelu_rational_gate`), elsewhere with MLX's tanh (`gelu_tanh_gate`). mx.compile fuses a chain
    of element-wise ops at most 11 deep into one kernel, so the rational form's 21 make 5-7
    kernels where mlx-lm's makes one: on a GPU, where a small model's forward is bound by the
    host launching its kernels (docs/performance.md, "A 270M cycle is the host launching
    kernels"), 4 launches fewer a layer. Prefill, decode and verify all take the same one on a
    backend."""
    return (gelu_rational_gate if backend() == "cpu" else gelu_tanh_gate)(gate, up)


def block(layer, groups: dict, h: mx.array, mask, cache, kernels) -> mx.array:
    """mlx-lm's Gemma 3 TransformerBlock (its float16 residual clip included) with
    `gelu_approx_gate` in the MLP: a prefill computes what decode and verify do."""
    from mlx_lm.models.gemma3_text import clip_residual

    r = prefill_attention(layer, groups, h, mask, cache, kernels)
    h = clip_residual(h, layer.post_attention_layernorm(r))
    r = gated_mlp(layer.mlp, layer.pre_feedforward_layernorm(h), gelu_approx_gate, kernels)
    return clip_residual(h, layer.post_feedforward_layernorm(r))


class NormScales:
    """Gemma's RMSNorm scales by `1 + weight`, and mlx-lm adds the one at every call: inside a
    compiled block on a GPU that add is a kernel launch of its own before each norm, six a layer, a
    fifth of a 270M decode step's launches (docs/performance.md, "Fewer launches: Gemma's norm
    scales, fused residual norms"). Here each norm's scale is made once, at load, by the same add:
    the norm's bits are mlx-lm's. A norm whose weight was replaced since gets its scale made anew."""

    def __init__(self, model):
        from mlx_lm.models.gemma3_text import RMSNorm

        self.scales = {id(m): (m, m.weight, 1.0 + m.weight) for _, m in model.named_modules() if isinstance(m, RMSNorm)}
        mx.eval([scale for _, _, scale in self.scales.values()])

    def of(self, norm) -> tuple[mx.array, float]:
        """The norm's (scale, eps) as its call passes them to MLX's rms_norm."""
        module, weight, scale = self.scales.get(id(norm), (None, None, None))
        if module is not norm or norm.weight is not weight:
            return 1.0 + norm.weight, norm.eps
        return scale, norm.eps

    def __call__(self, norm, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, *self.of(norm))


def attention_output_and_mlp(layer, groups: dict, kernels, norm, next_norm=None):
    """What mlx-lm's TransformerBlock does after attention (its float16 residual clip included):
    h, or (h, next_norm(h)) where the next layer's input norm is given; `norm(module, x)` applies
    a norm (`NormScales`)."""
    from mlx_lm.models.gemma3_text import clip_residual

    def post(h, attended):
        B, L, _ = h.shape
        r = linear(layer.self_attn.o_proj, attended.transpose(0, 2, 1, 3).reshape(B, L, -1), kernels)
        if h.dtype == mx.float16:  # (the clip: float32 sums)
            h = clip_residual(h, norm(layer.post_attention_layernorm, r))
            r = gated_mlp(layer.mlp, norm(layer.pre_feedforward_layernorm, h), gelu_approx_gate, kernels,
                          groups.get("gate_up"))
            h = clip_residual(h, norm(layer.post_feedforward_layernorm, r))
            return h if next_norm is None else (h, norm(next_norm, h))
        h, x = add_norm(h, r, *norm.of(layer.pre_feedforward_layernorm), kernels,
                        branch=norm.of(layer.post_attention_layernorm))
        r = gated_mlp(layer.mlp, x, gelu_approx_gate, kernels, groups.get("gate_up"))
        if next_norm is None:
            return add_normed(h, r, *norm.of(layer.post_feedforward_layernorm), kernels)
        return add_norm(h, r, *norm.of(next_norm), kernels, branch=norm.of(layer.post_feedforward_layernorm))

    return post


def window_attention(q, k, v, cache: SlidingWindowCache, scale: float, mask: mx.array, kernels) -> mx.array:
    """Write k, v into a sliding layer's ring and attend over it with the row's mask: one query
    through mlx-lm's attention, a block through the block attention."""
    k, v = cache.update_and_fetch(k, v)
    if q.shape[2] == 1:
        return single_query(q, k, v, cache, scale, mask, kernels)
    return attention(q, [k], [v], scale, mask, kernels)


def window_rows_layout(rows: Rows, caches) -> tuple[mx.array, mx.array] | None:
    """The rows' rings as `attend_window_rows` writes and reads them (every sliding layer's rings
    hold the same positions, so made once per forward): the slots each row writes [rows, 1,
    longest, 1] and the mask [rows, 1, longest, capacity]; None where the rows cannot attend as one
    batch: a ring not written yet, rings of other capacities, or a row writing more than its slack."""
    ring = caches[0]
    if any(c.holds_nothing() or c.capacity != ring.capacity or c.window != ring.window for c in caches):
        return None
    if rows.longest > ring.capacity - ring.window + 1:
        return None
    mask = ring_mask(rows.batch_offsets, rows.longest, ring.window, ring.capacity)
    return ring_slots(rows.batch_offsets, rows.longest, ring.capacity), mask[:, None]


def attend_window_rows(q, k, v, rows: Rows, caches, scale: float, rope, layout: tuple, kernels) -> mx.array:
    """A sliding layer's attention for several rows as one batch, q, k, v [1, sum L, heads, D] on
    the token axis (before RoPE): `window_batch_keys`, then one attention over them."""
    return attend_batch(*window_batch_keys(q, k, v, rows, caches, rope, layout), rows, scale, kernels)


def window_batch_keys(q, k, v, rows: Rows, caches, rope, layout: tuple) -> tuple[mx.array, ...]:
    """`batch_keys` for a sliding layer: RoPE at every row's offset in one op, the new keys
    scattered into the rows' rings stacked as one (`rows.write_ring_rows`), as `window_rows_layout`
    says; the queries, the stacked rings and their mask. A row sees exactly the slots it sees
    alone, in the same order."""
    slots, mask = layout
    q_b, k_b = rope(rows.batch_offsets, rows.layout.batched(q), rows.layout.batched(k))
    v_b = heads_first(rows.layout.batched(v))
    keys, values = write_ring_rows(caches, rows.starts, [e - s for s, e in rows.bounds], k_b, v_b, slots, rows.stacked)
    return q_b, keys, values, mask


class Gemma3Adapter(TargetAdapter):
    family = "gemma3_text"

    def __init__(self, model, kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__(model, kernels)
        self.norms = NormScales(self.text_model)

    @property
    def args(self):
        return self.text_model.args

    def logits(self, hidden: mx.array) -> mx.array:
        return self.decode_lm_head(self.norms(self.inner.norm, hidden))

    def _is_global(self, i: int) -> bool:
        pattern = self.args.sliding_window_pattern
        return i % pattern == pattern - 1

    def layer_groups(self, layer):
        attn = layer.self_attn
        return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], **gated_mlp_group(layer.mlp)}

    def make_cache(self, max_rollback: int) -> list:
        return [
            RowsKVCache() if self._is_global(i) else SlidingWindowCache(self.args.sliding_window, slack=max_rollback)
            for i in range(len(self.layers))
        ]

    def _embed(self, tokens):
        h = self.embed(tokens)
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def run_layers(self, tokens, cache, tap_ids, states):
        """Prefill: mlx-lm's layers' modules (`block`)."""
        h = self._embed(tokens)
        sliding = next((c for c in cache if isinstance(c, SlidingWindowCache)), None)
        sliding_mask = sliding.mask(tokens.shape[1]) if sliding is not None else None
        tapped = {}
        for i, (layer, groups, layer_cache) in enumerate(zip(self.layers, self.shared_inputs, cache)):
            h = block(layer, groups, h, "causal" if self._is_global(i) else sliding_mask, layer_cache,
                      self.prefill_kernels)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def run_rows(self, tokens, rows, tap_ids):
        """Decode and verify. The global layers attend for all rows as one batch (`attend_rows`, as
        in the dense adapter), the sliding layers too (`attend_window_rows`) where the rows' rings
        allow, else per row over its ring; the rings' masks are taken before any layer writes."""
        h = self._embed(tokens)
        x = self.norms(self.layers[0].input_layernorm, h)  # each layer's post makes the next one's
        sliding = next((i for i in range(len(self.layers)) if not self._is_global(i)), None)
        layout = None
        if sliding is not None and len(rows.rows) > 1:
            layout = window_rows_layout(rows, rows.caches(sliding))
        sliding_masks = []
        if sliding is not None and layout is None:
            sliding_masks = [r.cache[sliding].mask(e - s) for r, (s, e) in zip(rows.rows, rows.bounds)]
        tapped = {}
        for i, (layer, groups) in enumerate(zip(self.layers, self.shared_inputs)):
            attn = layer.self_attn
            if len(rows.rows) == 1:  # RoPE in the projections' block
                q, k, v = self.compiled(("pre_rope", i), lambda: rotated(
                    attention_inputs(layer, groups, self.kernels, self.norms), attn))(x, rows.offsets[0])
                if self._is_global(i):
                    attended = attend_row(q, k, v, rows, rows.caches(i), attn.scale, self.kernels)
                else:
                    attended = window_attention(q, k, heads_first(v), rows.caches(i)[0], attn.scale, sliding_masks[0],
                                                self.kernels)
                h, x = self._after_attention(i, layer, groups, h, attended, rows, tapped, tap_ids)
                continue
            q, k, v = self.compiled(("pre", i), lambda: attention_inputs(layer, groups, self.kernels, self.norms))(x)
            rope = self.compiled(("rope", i), lambda: rotary(attn))
            if self._is_global(i):
                attended = attend_rows(q, k, v, rows, rows.caches(i), attn.scale, rope, self.kernels)
            elif layout is not None:
                attended = attend_window_rows(q, k, v, rows, rows.caches(i), attn.scale, rope, layout, self.kernels)
            else:
                parts = []
                for (s, e), layer_cache, offset, sliding_mask in zip(rows.bounds, rows.caches(i), rows.offsets,
                                                                     sliding_masks):
                    q_row, k_row = rope(offset, part(q, s, e), part(k, s, e))
                    parts.append(window_attention(q_row, k_row, heads_first(part(v, s, e)), layer_cache, attn.scale,
                                                  sliding_mask, self.kernels))
                attended = join(parts, axis=2)
            h, x = self._after_attention(i, layer, groups, h, attended, rows, tapped, tap_ids)
        return h, tapped

    def _after_attention(self, i, layer, groups, h, attended, rows, tapped: dict, tap_ids):
        """Layer i's block after attention: h and the next layer's normed input (queued, tapped)."""
        following = self.next_input_norm(i)
        post = self.compiled(("post", i), lambda: attention_output_and_mlp(layer, groups, self.kernels, self.norms,
                                                                           following))
        h, x = with_next_input(post(h, attended), following)
        self.queue_layers(i, h, rows)
        if i in tap_ids:
            tapped[i] = h
        return h, x
