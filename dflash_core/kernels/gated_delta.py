"""The gated delta recurrence (GatedDeltaNet), behind the backend gate.

    state_t = g_t * state_{t-1} + k_t (beta_t * (v_t - (g_t * state_{t-1}) k_t))^T ;  y_t = state_t q_t

Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] (float32).
Metal keeps mlx-lm's kernel, CUDA uses ours (gated_delta_cuda.py), everything else the pure-MLX
reference, which tests compare every available path against.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gated_delta as mlx_lm_gated_delta

from . import backend, gated_delta_cuda


def path_for(q, v, g) -> str:
    if backend() == "metal" and q.shape[-1] % 32 == 0:
        return "metal"
    if backend() == "cuda" and gated_delta_cuda.supported(q, v, g):
        return "cuda"
    return "reference"


def records_step_states() -> bool:
    """Whether a verify should keep the state after every step (`gated_delta_step_states`) so that a
    rollback picks one instead of replaying the recurrence (unless `KernelOptions.step_states` is
    off). On CUDA our kernel writes them in the same launch; elsewhere a replay is cheaper than a
    per-step loop. The price is memory: a verify's rollback record holds T states per layer (16 x
    2 MB x 24 layers = 0.8 GB for Qwen3.5-9B, about 2.4 GB for Qwen3.5-27B) until its cycle is
    accepted or rolled back, one per generation in flight. (Shapes the CUDA kernel does not take
    would get the per-step loop; no released Qwen3.5 has them.)"""
    return backend() == "cuda"


def gated_delta_step_states(q, k, v, g, beta, state) -> tuple[mx.array, mx.array, mx.array]:
    """`gated_delta` plus the state after every step, [B, T, Hv, Dv, Dk]: states[:, t] is exactly
    the final state of running steps 0..t alone."""
    if path_for(q, v, g) == "cuda":
        return gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, step_states=True)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = gated_delta(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), state, mx.stack(states, axis=1)


def gated_delta(q, k, v, g, beta, state) -> tuple[mx.array, mx.array]:
    """Run T steps of the recurrence; returns (y [B, T, Hv, Dv], final state)."""
    path = path_for(q, v, g)
    if path == "metal":
        return mlx_lm_gated_delta.gated_delta_kernel(q, k, v, g, beta, state)
    if path == "cuda":
        return gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state)
    return reference(q, k, v, g, beta, state)


def reference(q, k, v, g, beta, state) -> tuple[mx.array, mx.array]:
    """Pure-MLX path (every backend): mlx-lm's ops implementation, one compiled step per token."""
    return mlx_lm_gated_delta.gated_delta_ops(q, k, v, g, beta, state)


def active_path() -> str:
    """Which implementation `gated_delta` uses here (for `dflash doctor`)."""
    return {
        "metal": "mlx-lm Metal kernel",
        "cuda": "dflash CUDA kernel (one launch per layer)",
        "cpu": "pure MLX (one compiled step per token)",
    }[backend()]
