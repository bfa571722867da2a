"""The gated delta recurrence (GatedDeltaNet), behind the backend gate.

    state_t = g_t * state_{t-1} + k_t (beta_t * (v_t - (g_t * state_{t-1}) k_t))^T ;  y_t = state_t q_t

Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] (float32).
Metal keeps mlx-lm's kernel, CUDA uses ours (gated_delta_cuda.py), everything else the pure-MLX
reference, which tests compare every available path against.
"""

from __future__ import annotations

from typing import Optional, Sequence

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
    per-step loop. Kept as states, a verify's rollback record holds T states per layer (16 x 2 MB x
    24 layers = 0.8 GB for Qwen3.5-9B, about 2.4 GB for Qwen3.5-27B) until its cycle is accepted or
    rolled back, one per generation in flight; kept as deltas (`KernelOptions.step_deltas`, the
    default), 1/Dk of that. (Shapes the CUDA kernel does not take would get the per-step loop; no
    released Qwen3.5 has them.)"""
    return backend() == "cuda"


def replays_deltas(head_k_dim: int, head_v_dim: int) -> bool:
    """Whether a verify of a layer of these head sizes records deltas when `KernelOptions.step_deltas`
    asks for them: where our CUDA kernel runs it, whose replay repeats its roundings. Elsewhere the
    deltas would come from `reference_steps`, whose roundings the layer's other forwards (mlx-lm's
    compiled steps) do not promise, so such a verify keeps step states instead. (No released
    Qwen3.5 has head sizes the kernel does not take.)"""
    return backend() == "cuda" and gated_delta_cuda.supports_heads(head_k_dim, head_v_dim)


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


def gated_delta_deltas(q, k, v, g, beta, state) -> tuple[mx.array, mx.array, mx.array]:
    """`gated_delta` plus each step's delta, [B, T, Hv, Dv] float32: the factor of the step's
    rank-one update, `state_t = state_{t-1} * g_t + k_t (x) delta_t`, so that `replay` of the first
    `keep` steps gives exactly the final state of running those steps alone, from 1/Dk of the
    memory step states take (`KernelOptions.step_deltas`)."""
    if path_for(q, v, g) == "cuda":
        return gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, deltas=True)
    return reference_steps(q, k, v, g, beta, state, deltas=True)


def replay(k, g, deltas, state, keeps: Sequence[int], keeps_array: Optional[mx.array] = None) -> mx.array:
    """Each row's state after its first keeps[b] steps ([B, Hv, Dv, Dk]), from the state before
    them and the steps' keys, decays and deltas (`gated_delta_deltas`). `keeps_array`: the keeps
    as int32 on the device, where the caller has them (a batched rollback, for every layer)."""
    if backend() == "cuda" and gated_delta_cuda.supported(k, deltas, g):
        keeps_array = mx.array(list(keeps), dtype=mx.int32) if keeps_array is None else keeps_array
        return gated_delta_cuda.replay_cuda(k, g, deltas, state, keeps_array)
    if (repeat := deltas.shape[2] // k.shape[2]) > 1:
        k = mx.repeat(k, repeat, -2)
    for t in range(max(keeps)):
        updated = _update(state, k[:, t], g[:, t], deltas[:, t])
        state = updated if min(keeps) > t else mx.where(mx.array([keep > t for keep in keeps])[:, None, None, None],
                                                          updated, state)
    return state


def _update(state, k, g, delta):
    # A step's update as `reference_steps` makes it: the decay, then the rank-one write.
    return state * g[..., None, None] + k[..., None, :] * delta[..., None]


def reference_steps(q, k, v, g, beta, state, deltas: bool = False) -> tuple:
    """The recurrence in plain MLX ops, step by step and not compiled (mlx-lm's step compiled, on
    the CPU, does not promise the roundings of its separate ops), so that each step's state is
    exactly `_update` of the one before: (y, final state), and the steps' deltas with `deltas`.
    Scalar gates only. Tests run the whole pure-MLX path on it where they check rollbacks that
    replay deltas."""
    B, T, Hk, Dk = q.shape
    if (repeat := v.shape[2] // Hk) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, kept = [], []
    for t in range(T):
        k_t = k[:, t]
        decayed = state * g[:, t][..., None, None]
        delta = (v[:, t] - (decayed * k_t[..., None, :]).sum(axis=-1)) * beta[:, t][..., None]
        state = decayed + k_t[..., None, :] * delta[..., None]
        ys.append((state * q[:, t][..., None, :]).sum(axis=-1))
        kept.append(delta)
    out = (mx.stack(ys, axis=1), state)
    return out + (mx.stack(kept, axis=1),) if deltas else out


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
        "cuda": "dflash CUDA kernel (one launch per layer; verifies record each step's delta, rollbacks replay them)",
        "cpu": "pure MLX (one compiled step per token)",
    }[backend()]
