"""The gated delta recurrence as one CUDA kernel (mx.fast.cuda_kernel), for MLX's CUDA backend.

Off Metal, mlx-lm runs the recurrence as a Python loop of small ops per time step, so a 16-token
verify costs 16 x (layers) launches and prefill crawls. Here one warp owns one row (b, head, dv)
of the state; each lane keeps Dk/32 state elements in registers and the two dot products per step
are warp reductions. All T steps run inside the kernel: one launch per layer, whatever T is.
The arithmetic and its order per element follow mlx-lm's Metal kernel (float32 state, decay, then
delta rule), so results match the pure-MLX reference to rounding. The state update is written as
explicit roundings (`__fmul_rn`, `__fmaf_rn`), which the compiler never contracts or reorders, so
that a rollback's replay of the updates (`replay_cuda`) gives the bits the verify gave (on an H100
the explicit form gave the same bits as the form before, which left them to the compiler:
docs/performance.md, "Record each step's delta").
"""

from __future__ import annotations

import functools

import mlx.core as mx

# Which state row a thread works on: one warp per (b, head, dv), Dk/32 elements per lane. The
# recurrence and the replay share it.
_ROW = """
    constexpr int n_per_lane = Dk / 32;
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;  // b * Hv + hv
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    const int steps = T[0];
"""
# Its state row in registers (s), and where the new one goes.
_STATE_IN = """
    auto s_in = state_in + ((size_t)n * Dv + dv_idx) * Dk + n_per_lane * lane;
    auto s_out = state_out + ((size_t)n * Dv + dv_idx) * Dk + n_per_lane * lane;

    float s[n_per_lane];
    #pragma unroll
    for (int i = 0; i < n_per_lane; ++i) s[i] = static_cast<float>(s_in[i]);
"""

_SOURCE = _ROW + """
    auto q_ = q + ((size_t)b_idx * steps * Hk + hk_idx) * Dk + n_per_lane * lane;
    auto k_ = k + ((size_t)b_idx * steps * Hk + hk_idx) * Dk + n_per_lane * lane;
    auto v_ = v + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
    auto y_ = y + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
    auto g_ = g + (size_t)b_idx * steps * Hv + hv_idx;
    auto beta_ = beta + (size_t)b_idx * steps * Hv + hv_idx;
""" + _STATE_IN + """
    for (int t = 0; t < steps; ++t) {
      const float decay = static_cast<float>(*g_);
      float kv_mem = 0.0f;
      float kk[n_per_lane];
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) {
        kk[i] = static_cast<float>(k_[i]);
        s[i] = __fmul_rn(s[i], decay);
        kv_mem += s[i] * kk[i];
      }
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, offset);
      const float delta = (static_cast<float>(*v_) - kv_mem) * static_cast<float>(*beta_);
      float out = 0.0f;
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) {
        s[i] = __fmaf_rn(kk[i], delta, s[i]);
        out += s[i] * static_cast<float>(q_[i]);
      }
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) out += __shfl_xor_sync(0xffffffff, out, offset);
      if (lane == 0) *y_ = static_cast<OutT>(out);
      // per-step state (written here by the step-states variant)
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    #pragma unroll
    for (int i = 0; i < n_per_lane; ++i) s_out[i] = static_cast<StT>(s[i]);
"""


# The state after every step as well, [B, T, Hv, Dv, Dk]: a verify that records them lets the
# rollback pick the state after `keep` tokens instead of replaying the recurrence.
_STEP_STATES = """
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) st_[i] = static_cast<StT>(s[i]);
      st_ += (size_t)Hv * Dv * Dk;"""
_STEP_STATES_SETUP = """
    auto st_ = states + (((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx) * Dk + n_per_lane * lane;
"""


# Or each step's delta, [B, T, Hv, Dv] (one float per state row, 1/Dk of the states): a step's update
# is rank one, s_t = s_{t-1} * g_t + k_t (x) delta_t, so a rollback can replay the kept steps' updates
# from the state before the verify (`replay_cuda`), element-wise, with the same two roundings.
_DELTAS = """
      if (lane == 0) *dl_ = delta;
      dl_ += Hv * Dv;"""
_DELTAS_SETUP = """
    auto dl_ = deltas + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
"""

_REPLAY = _ROW + """    const int keep = keeps[b_idx];

    auto k_ = k + ((size_t)b_idx * steps * Hk + hk_idx) * Dk + n_per_lane * lane;
    auto g_ = g + (size_t)b_idx * steps * Hv + hv_idx;
    auto dl_ = deltas + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
""" + _STATE_IN + """    for (int t = 0; t < keep; ++t) {
      const float decay = static_cast<float>(*g_);
      const float delta = *dl_;
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) {
        const float kk = static_cast<float>(k_[i]);
        s[i] = __fmul_rn(s[i], decay);
        s[i] = __fmaf_rn(kk, delta, s[i]);
      }
      k_ += Hk * Dk;
      g_ += Hv;
      dl_ += Hv * Dv;
    }
    #pragma unroll
    for (int i = 0; i < n_per_lane; ++i) s_out[i] = static_cast<StT>(s[i]);
"""


@functools.cache
def _kernel(record: str = ""):
    """The recurrence kernel; `record` "step_states" or "deltas" also writes those."""
    name, outputs, source = "dflash_gated_delta", ["y", "state_out"], _SOURCE
    if record:
        setup, write, output = {"step_states": (_STEP_STATES_SETUP, _STEP_STATES, "states"),
                                "deltas": (_DELTAS_SETUP, _DELTAS, "deltas")}[record]
        name, outputs = f"{name}_{record}", outputs + [output]
        edits = {"    float s[n_per_lane];": setup + "    float s[n_per_lane];",
                 "      // per-step state (written here by the step-states variant)": write}
        for anchor, text in edits.items():
            assert source.count(anchor) == 1, anchor  # else the record would be left unwritten
            source = source.replace(anchor, text)
    return mx.fast.cuda_kernel(
        name=name, input_names=["q", "k", "v", "g", "beta", "state_in", "T"], output_names=outputs, source=source)


@functools.cache
def _replay_kernel():
    return mx.fast.cuda_kernel(name="dflash_gated_delta_replay", input_names=["k", "g", "deltas", "state_in", "keeps", "T"],
                               output_names=["state_out"], source=_REPLAY)


def supported(q: mx.array, v: mx.array, g: mx.array) -> bool:
    """Shapes this kernel handles: scalar gates and `supports_heads`."""
    return g.ndim == 3 and supports_heads(q.shape[-1], v.shape[-1])


def supports_heads(head_k_dim: int, head_v_dim: int) -> bool:
    """Head sizes this kernel handles: Dk a multiple of 32, Dv a multiple of 4."""
    return head_k_dim % 32 == 0 and head_v_dim % 4 == 0


def gated_delta_cuda(q, k, v, g, beta, state, step_states: bool = False, deltas: bool = False) -> tuple[mx.array, ...]:
    """(y, final state), plus the state after every step [B, T, Hv, Dv, Dk] with step_states, or
    each step's delta [B, T, Hv, Dv] (float32) with deltas."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    rows_per_block = 4
    shapes, dtypes = [(B, T, Hv, Dv), state.shape], [q.dtype, state.dtype]
    if step_states:
        shapes.append((B, T) + tuple(state.shape[1:]))
        dtypes.append(state.dtype)
    elif deltas:
        shapes.append((B, T, Hv, Dv))
        dtypes.append(mx.float32)
    record = "step_states" if step_states else "deltas" if deltas else ""
    return tuple(_kernel(record)(
        inputs=[q, k, v, g, beta, state, mx.array([T], dtype=mx.int32)],
        template=[("OutT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, rows_per_block, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    ))


def replay_cuda(k, g, deltas, state, keeps: mx.array) -> mx.array:
    """Each row's state after its first keeps[b] steps (int32 [B]), from the state before them
    and the steps' keys, decays and deltas (`gated_delta_cuda(..., deltas=True)`): the same bits as
    running those steps alone, since each element takes the same two roundings in the same order."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = deltas.shape[2:]
    return _replay_kernel()(
        inputs=[k, g, deltas, state, keeps, mx.array([T], dtype=mx.int32)],
        template=[("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1), output_shapes=[state.shape], output_dtypes=[state.dtype])[0]
