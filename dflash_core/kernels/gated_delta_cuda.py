"""The gated delta recurrence as one CUDA kernel (mx.fast.cuda_kernel), for MLX's CUDA backend.

Off Metal, mlx-lm runs the recurrence as a Python loop of small ops per time step, so a 16-token
verify costs 16 x (layers) launches and prefill crawls. Here one warp owns one row (b, head, dv)
of the state; each lane keeps Dk/32 state elements in registers and the two dot products per step
are warp reductions. All T steps run inside the kernel: one launch per layer, whatever T is.
The arithmetic and its order per element follow mlx-lm's Metal kernel (float32 state, decay, then
delta rule), so results match the pure-MLX reference to rounding.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_SOURCE = """
    constexpr int n_per_lane = Dk / 32;
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;  // b * Hv + hv
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    const int steps = T[0];

    auto q_ = q + ((size_t)b_idx * steps * Hk + hk_idx) * Dk + n_per_lane * lane;
    auto k_ = k + ((size_t)b_idx * steps * Hk + hk_idx) * Dk + n_per_lane * lane;
    auto v_ = v + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
    auto y_ = y + ((size_t)b_idx * steps * Hv + hv_idx) * Dv + dv_idx;
    auto g_ = g + (size_t)b_idx * steps * Hv + hv_idx;
    auto beta_ = beta + (size_t)b_idx * steps * Hv + hv_idx;
    auto s_in = state_in + ((size_t)n * Dv + dv_idx) * Dk + n_per_lane * lane;
    auto s_out = state_out + ((size_t)n * Dv + dv_idx) * Dk + n_per_lane * lane;

    float s[n_per_lane];
    #pragma unroll
    for (int i = 0; i < n_per_lane; ++i) s[i] = static_cast<float>(s_in[i]);

    for (int t = 0; t < steps; ++t) {
      const float decay = static_cast<float>(*g_);
      float kv_mem = 0.0f;
      float kk[n_per_lane];
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) {
        kk[i] = static_cast<float>(k_[i]);
        s[i] = s[i] * decay;
        kv_mem += s[i] * kk[i];
      }
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, offset);
      const float delta = (static_cast<float>(*v_) - kv_mem) * static_cast<float>(*beta_);
      float out = 0.0f;
      #pragma unroll
      for (int i = 0; i < n_per_lane; ++i) {
        s[i] = s[i] + kk[i] * delta;
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


@functools.cache
def _kernel(step_states: bool = False):
    name, outputs, source = "dflash_gated_delta", ["y", "state_out"], _SOURCE
    if step_states:
        name, outputs = name + "_step_states", outputs + ["states"]
        edits = {"    float s[n_per_lane];": _STEP_STATES_SETUP + "    float s[n_per_lane];",
                 "      // per-step state (written here by the step-states variant)": _STEP_STATES}
        for anchor, text in edits.items():
            assert source.count(anchor) == 1, anchor  # else `states` would be left unwritten
            source = source.replace(anchor, text)
    return mx.fast.cuda_kernel(
        name=name, input_names=["q", "k", "v", "g", "beta", "state_in", "T"], output_names=outputs, source=source)


def supported(q: mx.array, v: mx.array, g: mx.array) -> bool:
    """Shapes this kernel handles: scalar gates, Dk a multiple of 32, Dv a multiple of 4."""
    return g.ndim == 3 and q.shape[-1] % 32 == 0 and v.shape[-1] % 4 == 0


def gated_delta_cuda(q, k, v, g, beta, state, step_states: bool = False) -> tuple[mx.array, ...]:
    """(y, final state), plus the state after every step [B, T, Hv, Dv, Dk] with step_states."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    rows_per_block = 4
    shapes, dtypes = [(B, T, Hv, Dv), state.shape], [q.dtype, state.dtype]
    if step_states:
        shapes.append((B, T) + tuple(state.shape[1:]))
        dtypes.append(state.dtype)
    return tuple(_kernel(step_states)(
        inputs=[q, k, v, g, beta, state, mx.array([T], dtype=mx.int32)],
        template=[("OutT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, rows_per_block, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    ))
