"""Qwen3.5 / Qwen3.6 hybrids (dense and MoE): GatedDeltaNet layers plus full attention.

A GatedDeltaNet layer carries a conv state (the last K-1 inputs) and a recurrent state that cannot
be trimmed. The adapter runs the mixer itself over mlx-lm's projections so that, during a verify
forward, it can keep the pre-verify states and either the step inputs (q, k, v, g, beta) or, where
the kernel writes them in the same launch (CUDA), the state after every step, or (with
`KernelOptions.step_deltas`) each step's delta, the factor of its rank-one update. MLX arrays are
immutable, so keeping references is the snapshot. Rolling back to `keep` tokens then picks the
state after `keep` steps, replays the kept updates from the snapshot, or replays the recurrence over
those steps with the same kernel; either way no weight is read again and the state is the one a
forward of the kept tokens alone would give.

Decode and verify forwards (at most `compile_max_tokens` tokens) run as rows (`forward_rows`), a
plain forward being the one-row case: the rows' tokens are concatenated along the token axis, and
everything per token (norms, projections, the MLP or MoE block, the LM head) runs once on the
concatenation, while what depends on a generation's caches runs per row on its slice: RoPE, the
KV-cache update and attention of an attention layer one row at a time; the conv window and the
recurrence of a GatedDeltaNet layer once per group of rows of one length, their states stacked along
the batch axis (ops there are independent per batch row) and each row's new states, outputs and
rollback record sliced back out (a row's cache then holds a view of its group's buffer; snapshots
copy what they keep, cache.owned). With a matmul that rounds a row the same whatever the other rows
(MLX's CPU reference BLAS), each row then gets exactly what it gets alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..cache import RowsArraysCache, RowsKVCache
from ..kernels.gated_delta import (
    gated_delta,
    gated_delta_deltas,
    gated_delta_step_states,
    records_step_states,
    replay,
    replays_deltas,
)
from ..kernels.matmul import gated_mlp, linear, linears
from ..kernels.norms import add_norm, norm_of, residual
from .base import (
    Rows,
    TargetAdapter,
    attend_row,
    attend_rows,
    gated_mlp_group,
    join,
    part,
    rotary,
    rotated,
    with_next_input,
)


def _row_of(x: Optional[mx.array], row: int) -> Optional[mx.array]:
    """Row `row` of a batch [R, ...] as [1, ...]; a batch of one row is itself."""
    return x if x is None or x.shape[0] == 1 else x[row : row + 1]


class GatedDeltaRecord:
    """What a rollback of one GatedDeltaNet layer needs from the recorded forward, for one row. Its
    arrays are those of the row's batch ([R, ...]), of which it is row `row`, sliced out only when
    a rollback of this row alone reads them: the rows of one batch roll back in one gather (or replay) per layer
    (`Qwen35Adapter.rollback_rows`), and a record that is never rolled back is never sliced."""

    __slots__ = ("_conv_input", "_state", "steps", "_step_states", "_deltas", "row")

    def __init__(self, conv_input: mx.array, state: mx.array, steps: Optional[tuple] = None,
                 step_states: Optional[mx.array] = None, row: int = 0, deltas: Optional[tuple] = None):
        self._conv_input = conv_input  # the conv state before the forward, then its inputs
        self._state = state  # the recurrent state before the forward
        self.steps = steps  # the row's own (q, k, v, g, beta), replayed up to `keep`; or
        self._step_states = step_states  # the state after every step [R, T, Hv, Dv, Dk]; or
        self._deltas = deltas  # the steps' keys, decays and deltas ([R, T, ...] each), replayed
        self.row = row

    @property
    def conv_input(self) -> mx.array:
        return _row_of(self._conv_input, self.row)

    @property
    def state(self) -> mx.array:
        return _row_of(self._state, self.row)

    @property
    def step_states(self) -> Optional[mx.array]:
        return _row_of(self._step_states, self.row)

    @property
    def deltas(self) -> Optional[tuple]:
        return None if self._deltas is None else tuple(_row_of(x, self.row) for x in self._deltas)

    @property
    def batch(self) -> Optional[tuple]:
        """With step states or deltas: the batch's conv inputs [R, T + K - 1, C], its states after
        each step [R, T, ...] or its (keys, decays, deltas), its states before the forward, and this
        row's index there."""
        kept = self._step_states if self._step_states is not None else self._deltas
        return None if kept is None else (self._conv_input, kept, self._state, self.row)


def gated_delta_inputs(layer, groups: dict, kernels):
    """Everything of a GatedDeltaNet layer before its conv that is per token, from its input norm's
    output: the projections, the decay g and the write strength beta (mlx-lm's
    GatedDeltaNet.__call__)."""
    m = layer.linear_attn

    def pre(x):
        B, S, _ = x.shape
        qkv, z, b, a = linears(groups["in_proj"], x, kernels)
        return qkv, z.reshape(B, S, m.num_v_heads, m.head_v_dim), compute_g(m.A_log, a, m.dt_bias), mx.sigmoid(b)

    return pre


def depthwise_conv(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """mlx-lm's `conv1d` of a GatedDeltaNet (depthwise, no padding, no bias) as its K taps' products
    summed in tap order in float32, rounded once to x's dtype: the same bits for a position whatever
    the number of positions, which MLX's CUDA conv (cuDNN, an algorithm picked per shape) does not
    promise a 1-token step and a 16-token verify."""
    w = conv.weight[:, :, 0].astype(mx.float32)  # [C, K]
    taps = w.shape[1]
    n = x.shape[1] - taps + 1
    xf = x.astype(mx.float32)
    out = xf[:, :n] * w[:, 0]
    for k in range(1, taps):
        out = out + xf[:, k : k + n] * w[:, k]
    return out.astype(x.dtype)


def gated_delta_mixer(m, step_states: bool, deltas: bool = False):
    """One sequence's conv and recurrence from its conv state and recurrent state; returns the
    output, the new states and what a rollback needs: the conv input and either the recurrence's
    q, k, v (g and beta are the caller's), its per-step states, or (with `deltas`) its k and
    per-step deltas."""

    def mix(qkv, conv_state, state, g, beta):
        B, S, _ = qkv.shape
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(depthwise_conv(m.conv1d, conv_input))
        q, k, v = [
            t.reshape(B, S, heads, dim)
            for t, heads, dim in zip(
                mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
                [m.num_k_heads, m.num_k_heads, m.num_v_heads],
                [m.head_k_dim, m.head_k_dim, m.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        if step_states and deltas:
            y, new_state, stepped = gated_delta_deltas(q, k, v, g, beta, state)
            kept = (k, stepped)
        elif step_states:
            y, new_state, kept = gated_delta_step_states(q, k, v, g, beta, state)
        else:
            y, new_state = gated_delta(q, k, v, g, beta, state)
            kept = (q, k, v)
        return y, conv_input[:, -(m.conv_kernel_size - 1) :], new_state, conv_input, kept

    return mix


def gated_delta_output_and_mlp(layer, groups: dict, kernels, next_norm=None):
    """After the recurrence: h, or (h, next_norm(h)) where the next layer's input norm is given."""
    m = layer.linear_attn

    def post(h, y, z):
        B, S, _ = h.shape
        out = linear(m.out_proj, m.norm(y, z).reshape(B, S, -1), kernels)
        if m.sharding_group is not None:  # sharded (distributed.py): each rank holds part of the sum
            out = mx.distributed.all_sum(out, group=m.sharding_group)
        h, x = add_norm(h, out, *norm_of(layer.post_attention_layernorm), kernels)
        return residual(h, gated_mlp(layer.mlp, x, swiglu, kernels, groups.get("gate_up")), next_norm, kernels)

    return post


def gated_attention_inputs(layer, groups: dict, kernels):
    """Qwen3-Next attention up to RoPE (which needs a row's offset): q [B, S, Hq, D] and its output
    gate, k and v [B, S, Hkv, D]. Token-major, so that a row's slice is one contiguous block, laid
    out as it is when the row runs alone."""
    attn = layer.self_attn

    def pre(x):
        B, L, _ = x.shape
        q, k, v = linears(groups["qkv"], x, kernels)
        queries, gate = mx.split(q.reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
        k = attn.k_norm(k.reshape(B, L, attn.num_key_value_heads, -1))
        return attn.q_norm(queries), k, v.reshape(B, L, attn.num_key_value_heads, -1), gate.reshape(B, L, -1)

    return pre


def gated_attention_output_and_mlp(layer, groups: dict, kernels, next_norm=None):
    """After attention: h, or (h, next_norm(h)) where the next layer's input norm is given."""

    def post(h, attended, gate):
        B, L, _ = h.shape
        out = attended.transpose(0, 2, 1, 3).reshape(B, L, -1)
        r = linear(layer.self_attn.o_proj, out * mx.sigmoid(gate), kernels)
        h, x = add_norm(h, r, *norm_of(layer.post_attention_layernorm), kernels)
        return residual(h, gated_mlp(layer.mlp, x, swiglu, kernels, groups.get("gate_up")), next_norm, kernels)

    return post


class GatedDeltaGroup(NamedTuple):
    """Rows of a forward whose GatedDeltaNet conv and recurrence run as one batch: of one length and
    one way of recording (`step_states`), the same in every layer, so planned once per forward."""

    step_states: bool
    rows: list  # their indices in the forward
    spans: list  # their tokens on the token axis
    run: Optional[tuple]  # (start, end) where the rows' tokens sit one after another, else None
    in_order: bool  # the rows are consecutive indices: their outputs go back as one run


def gated_delta_groups(bounds, states, records_steps: bool) -> list[GatedDeltaGroup]:
    """The rows' groups (`GatedDeltaGroup`): a verify (recorded, more than one token) keeps per-step
    states where `records_steps`."""
    members: dict = {}
    for r, ((s, e), row_states) in enumerate(zip(bounds, states)):
        members.setdefault((e - s, row_states is not None and e - s > 1 and records_steps), []).append(r)
    groups = []
    for (_, step_states), rows in members.items():
        spans = [bounds[r] for r in rows]
        run = (spans[0][0], spans[-1][1]) if all(a[1] == b[0] for a, b in zip(spans, spans[1:])) else None
        groups.append(GatedDeltaGroup(step_states, rows, spans, run, rows == list(range(rows[0], rows[0] + len(rows)))))
    return groups


def _stack(x: mx.array, group: GatedDeltaGroup) -> mx.array:
    """The group's rows of `x` [1, T, ...] (all of one length L) as a batch [R, L, ...]: a reshape
    of one block where the rows sit one after another, else their slices stacked. One row is its
    own slice, as it was before rows were grouped."""
    spans = group.spans
    if len(spans) == 1:
        return part(x, *spans[0])
    if group.run is not None:
        return part(x, *group.run).reshape(len(spans), spans[0][1] - spans[0][0], *x.shape[2:])
    return mx.concatenate([part(x, s, e) for s, e in spans], axis=0)


def gated_delta_states(cache) -> tuple:
    """What a GatedDeltaNet layer's cache holds of its row in a batch: the batch itself where it
    holds a row of one (`cache.RowsArraysCache`, told without slicing it out), else its conv window
    and recurrent state."""
    row = cache.batch_row()
    return row if row is not None else (cache[0], cache[1])


def _row(x: mx.array, j: int, rows: list) -> mx.array:
    """Row j of a group's batch: a slice along the batch axis (x itself for a group of one)."""
    return x if len(rows) == 1 else x[j : j + 1]


def _unstack(y: mx.array, group: GatedDeltaGroup) -> list:
    """A group's output [R, L, ...] back on the token axis: (row, [1, L, ...]) per row, or, for rows
    that sit one after another, the first row with the whole run [1, R * L, ...] and the others
    with nothing (their tokens are in it)."""
    rows = group.rows
    if len(rows) == 1:
        return [(rows[0], y)]
    if group.in_order:
        return [(rows[0], y.reshape(1, -1, *y.shape[2:]))]
    return [(r, y[j : j + 1]) for j, r in enumerate(rows)]


class Qwen35Adapter(TargetAdapter):
    family = "qwen3_5"

    def make_cache(self, max_rollback: int) -> list:
        return [RowsArraysCache(size=2) if layer.is_linear else RowsKVCache() for layer in self.layers]

    def layer_groups(self, layer):
        if layer.is_linear:
            m = layer.linear_attn
            groups = {"in_proj": [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]}
        else:
            groups = {"qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]}
        return {**groups, **gated_mlp_group(layer.mlp)}

    def position(self, cache: list) -> int:
        """Tokens held: any attention layer's offset (GatedDeltaNet caches keep no count)."""
        return next(c for c, layer in zip(cache, self.layers) if not layer.is_linear).offset

    def run_rows(self, tokens, rows: Rows, tap_ids):
        # Every op on the concatenation is per token; a new total length traces the per-token
        # blocks again (a row's own blocks trace once per row length).
        h = self.embed(tokens)
        states = [None if record is None else record.states for record in rows.records]
        plan = gated_delta_groups(rows.bounds, states, self.kernels.step_states and records_step_states())
        x = self.layers[0].input_layernorm(h)  # each layer's block makes the next one's
        tapped = {}
        for i, (layer, groups) in enumerate(zip(self.layers, self.shared_inputs)):
            if layer.is_linear:
                h, x = self._gated_delta(i, layer, groups, h, x, rows.bounds, rows.caches(i), states, plan,
                                         compiled=True)
            else:
                h, x = self._attention_rows(i, layer, groups, h, x, rows)
            self.queue_layers(i, h, rows)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def _gated_delta(self, i, layer, groups, h, x, bounds, caches, states, plan: list, compiled: bool,
                     kernels=None):
        """A GatedDeltaNet layer over rows (h, and x its input norm's output): projections and MLP on
        all of h, and where `compiled` the next layer's input norm (returns h and that, or None); the
        conv and the recurrence once per group of rows of one length (and one way of recording:
        `plan`, from `gated_delta_groups`), the rows' states stacked along the batch axis (every op
        there is independent per batch row, so a row gets exactly what it gets alone) and split back
        into each row's cache. `states[r]` (recorded rows) gets the row's GatedDeltaRecord."""
        m = layer.linear_attn
        kernels = kernels or self.kernels

        def block(key, make):
            return self.compiled((key, i), make) if compiled else make()

        qkv, z, g, beta = block("gdn_in", lambda: gated_delta_inputs(layer, groups, kernels))(x)
        ys = [None] * len(bounds)
        for planned in plan:
            step_states, rows = planned.step_states, planned.rows
            group = [caches[r] for r in rows]
            # The rows' states as their last batched forward or rollback left them, stacked; else
            # each row's, stacked now.
            last = self.stacked_rows.take(group, tag="gdn") if len(rows) > 1 else None
            if last is None:
                conv_states, recurrent = [], []
                for r in rows:
                    conv_state, state = caches[r][0], caches[r][1]
                    if conv_state is None:
                        conv_state = mx.zeros((h.shape[0], m.conv_kernel_size - 1, m.conv_dim), dtype=h.dtype)
                        state = mx.zeros((h.shape[0], m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
                    conv_states.append(conv_state)
                    recurrent.append(state)
                last = join(conv_states, 0), join(recurrent, 0)
            conv_before, state_before = last
            deltas = step_states and kernels.step_deltas and replays_deltas(m.head_k_dim, m.head_v_dim)
            mix = block(("gdn_mix", step_states, deltas), lambda: gated_delta_mixer(m, step_states, deltas))
            g_rows = _stack(g, planned)
            y, conv_state, state, conv_input, kept = mix(_stack(qkv, planned), conv_before, state_before,
                                                         g_rows, _stack(beta, planned))
            batch = (conv_state, state)
            for j, r in enumerate(rows):
                layer_cache, (s, e) = caches[r], bounds[r]
                if len(rows) > 1:
                    layer_cache.hold_row(batch, j)  # its slices made only if read
                else:  # (both slots at once: a row of an earlier batch is not sliced out first)
                    layer_cache.cache = [_row(conv_state, j, rows), _row(state, j, rows)]
                if states[r] is None:
                    continue
                if e - s == 1:
                    # A one-token step is only ever undone whole (keep 0): what the row held before.
                    states[r].append(GatedDeltaRecord(conv_before, state_before, row=j))
                elif deltas:
                    states[r].append(GatedDeltaRecord(conv_input, state_before, row=j, deltas=(kept[0], g_rows, kept[1])))
                elif step_states:
                    states[r].append(GatedDeltaRecord(conv_input, state_before, None, kept, row=j))
                else:
                    steps = (*(_row(x, j, rows) for x in kept), part(g, s, e), part(beta, s, e))
                    states[r].append(GatedDeltaRecord(conv_input, state_before, steps, None, row=j))
            if len(rows) > 1:
                self.stacked_rows.keep(group, batch, read=gated_delta_states, tag="gdn")
            for r, piece in _unstack(y, planned):
                ys[r] = piece
        ys = [y for y in ys if y is not None]
        following = self.next_input_norm(i) if compiled else None
        out = block("gdn_out", lambda: gated_delta_output_and_mlp(layer, groups, kernels, following))(h, join(ys), z)
        return with_next_input(out, following)

    def _attention_rows(self, i, layer, groups, h, x, rows: Rows):
        """An attention layer over rows (h, and x its input norm's output): projections and MLP on
        all of h; RoPE, the cache update and attention for all rows as one batch (`attend_rows`);
        returns h and the next layer's input norm's output (None after the last layer)."""
        attn = layer.self_attn
        if len(rows.rows) == 1:  # RoPE in the projections' block
            q, k, v, gate = self.compiled(("attn_in_rope", i), lambda: rotated(
                gated_attention_inputs(layer, groups, self.kernels), attn))(x, rows.offsets[0])
            attended = attend_row(q, k, v, rows, rows.caches(i), attn.scale, self.kernels)
        else:
            q, k, v, gate = self.compiled(("attn_in", i), lambda: gated_attention_inputs(layer, groups, self.kernels))(x)
            rope = self.compiled(("rope", i), lambda: rotary(attn))
            attended = attend_rows(q, k, v, rows, rows.caches(i), attn.scale, rope, self.kernels)
        following = self.next_input_norm(i)
        post = self.compiled(("attn_out", i), lambda: gated_attention_output_and_mlp(layer, groups, self.kernels,
                                                                                     following))
        return with_next_input(post(h, attended, gate), following)

    def run_layers(self, tokens, cache, tap_ids, states):
        """Prefill (and any forward not in rows): eager, mlx-lm's own attention layers."""
        h = self.embed(tokens)
        attention_cache = next(c for c, layer in zip(cache, self.layers) if not layer.is_linear)
        mask = create_attention_mask(h, attention_cache)
        bounds = [(0, tokens.shape[1])]
        plan = gated_delta_groups(bounds, [states], self.kernels.step_states and records_step_states())
        tapped = {}
        for i, (layer, layer_cache, groups) in enumerate(zip(self.layers, cache, self.shared_inputs)):
            if layer.is_linear:
                h, _ = self._gated_delta(i, layer, groups, h, layer.input_layernorm(h), bounds, [layer_cache],
                                         [states], plan, compiled=False, kernels=self.prefill_kernels)
            else:
                h = layer(h, mask, layer_cache)
            if i in tap_ids:
                tapped[i] = h
        return h, tapped

    def rollback_rows(self, undos) -> None:
        """Rollbacks of several rows at once: the GatedDeltaNet layers of rows that were one batch
        of a verify with step states (or deltas) get their conv windows and states in one gather
        (or one replay) per layer, the same numbers `rollback` gives row by row; the others roll
        back one by one."""
        together = [(c, r, k) for c, r, k in undos if 0 < k < r.tokens and r.states and r.states[0].batch is not None]
        if len(together) < 2:
            return super().rollback_rows(undos)
        for cache, record, keep in undos:
            if not any(cache is c for c, _, _ in together):
                self.rollback(cache, record, keep)
        gated_layers = [i for i, layer in enumerate(self.layers) if layer.is_linear]
        indices: dict = {}
        for i, layer in enumerate(self.layers):
            if not layer.is_linear:
                for cache, record, keep in together:
                    cache[i].trim(record.tokens - keep)
        for n, i in enumerate(gated_layers):  # n: the layer's place in each record's states
            kernel = self.layers[i].linear_attn.conv_kernel_size
            batches: dict[int, list] = {}
            for cache, record, keep in together:
                batches.setdefault(id(record.states[n].batch[0]), []).append((cache, record.states[n], keep))
            for members in batches.values():
                conv_input, kept, before, _ = members[0][1].batch
                steps = (kept[2] if isinstance(kept, tuple) else kept).shape[1]
                # The same rows and keeps in every layer: their index arrays are made once (per
                # verify width: rows of two widths are two batches, whose row numbers may coincide).
                key = (kernel, steps, *((m.row, keep) for _, m, keep in members))
                if key not in indices:
                    rows = mx.array([m.row for _, m, _ in members])
                    keeps = mx.array([keep for _, _, keep in members], dtype=mx.int32)
                    indices[key] = rows, keeps, keeps[:, None] + mx.arange(kernel - 1)[None], rows * steps + keeps - 1
                rows, keeps, window_at, state_at = indices[key]
                windows = conv_input[rows[:, None], window_at]
                if isinstance(kept, tuple):  # deltas: each row's kept updates replayed (one launch)
                    if [m.row for _, m, _ in members] != list(range(before.shape[0])):
                        kept, before = tuple(mx.take(x, rows, axis=0) for x in kept), mx.take(before, rows, axis=0)
                    states = replay(*kept, before, [keep for _, _, keep in members], keeps)
                else:
                    # Each row's state after its kept steps: whole rows of the states laid out as
                    # one [R * T, state size] (a gather's cost is its index arithmetic per element:
                    # two dimensions here, against five for kept[rows, keeps - 1]).
                    states = mx.take(kept.reshape(kept.shape[0] * steps, -1), state_at, axis=0).reshape(-1, *kept.shape[2:])
                for b, (cache, _, _) in enumerate(members):
                    cache[i].hold_row((windows, states), b)  # its slices made only if read
                # Already one batch: the rows' next forward starts from it, if they run in this order.
                self.stacked_rows.keep([cache[i] for cache, _, _ in members], (windows, states),
                                       read=gated_delta_states, tag="gdn")

    def rollback(self, cache, record, keep):
        if keep >= record.tokens:
            return
        states = iter(record.states)
        for layer, layer_cache in zip(self.layers, cache):
            if not layer.is_linear:
                layer_cache.trim(record.tokens - keep)
                continue
            layer_record = next(states)
            # Conv state after `keep` tokens: the K-1 inputs ending at the last kept token.
            kernel = layer.linear_attn.conv_kernel_size
            conv_state = mx.contiguous(layer_record.conv_input[:, keep : keep + kernel - 1])
            if keep == 0:
                state = layer_record.state
            elif layer_record.deltas is not None:
                state = replay(*layer_record.deltas, layer_record.state, [keep])
            elif layer_record.step_states is not None:
                # A copy (MLX copies a view much smaller than its buffer), so that the cache and
                # prefix-cache snapshots of it do not pin all T states.
                state = mx.contiguous(layer_record.step_states[:, keep - 1])
            else:
                q, k, v, g, beta = (x[:, :keep] for x in layer_record.steps)
                _, state = gated_delta(q, k, v, g, beta, layer_record.state)
            layer_cache.cache = [conv_state, state]  # (both at once: a batch's row is not sliced out first)
