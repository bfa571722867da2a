"""The one backend gate for custom kernels, and the options that pick among their paths.

Every kernel has a pure-MLX fallback that is always correct and tested; a backend-specific
implementation is used only where `backend()` says it can run. Metal keeps mlx-lm's own kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


@functools.cache
def backend() -> str:
    """'metal', 'cuda' or 'cpu': where the default device's kernels run."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class KernelOptions:
    """Which of this project's own paths may run where the backend has them; on by default but one
    (`fused_norms`). Benchmarks turn one off to measure MLX's own in the same process: an adapter and a drafter are
    given one (`with_kernels`), and it is part of the key of their compiled functions, since a
    block reads it when it is traced. Frozen, so that a key never changes under a traced block."""

    block_attention: bool = True  # verify and draft blocks as stacked GEMMs (attention.py), else MLX's fused
    # On CUDA, a target's decode and verify attention in our kernel, each query rounded alike alone or
    # in a block (attention_cuda.py); else the stacked GEMMs and MLX's fused attention, which do not.
    exact_attention: bool = True
    # With exact_attention: bf16/fp16 head dims 16-256 on tensor cores (attention_mma_cuda.py), else the
    # scalar kernel; either way a query's bits do not depend on the others.
    tensor_core_attention: bool = True
    # With exact_attention: key slots per thread block (fixed per model, so that a decode and a verify
    # cut a query's keys alike), a multiple of 32; fewer blocks and partial sums at long context the
    # larger it is. 32 and 64 were no faster for the 270M's one KV head at 1K on an H100
    # (docs/performance.md, "A 270M cycle is the host launching kernels").
    attention_chunk: int = 128
    # With exact_attention: a drafter's blocks attend over [context ; block] as one key segment (the
    # two joined: two copies of the context buffer a layer), so that on CUDA they take the exact
    # kernel (two launches; four with the copies) rather than the stacked GEMMs over two segments
    # (about ten); the drafts' numbers change in the last bits, never the target's tokens. Elsewhere
    # the attention joins the segments itself, so it changes nothing there. On an H100 a 270M
    # draft's launches went 229 -> about 185 with `stream_parts` and its launch time 1.3 -> 0.9 ms a
    # cycle (docs/performance.md, "Fewer launches in the cycle"). Only while the context's keys are
    # small enough to copy (`attention.JOIN_MAX_BYTES`). Not for training: the kernel has no gradient.
    drafter_exact_attention: bool = True
    # With tensor_core_attention: warps per block at least, the extra ones loading tiles only (the
    # same bits); 1, not measured yet: a decode step's block loads with its one computing warp
    # (docs/performance.md, "Fewer launches: Gemma's norm scales, fused residual norms")
    attention_load_warps: int = 1
    # Verifies record every GatedDeltaNet step (CUDA), else rollbacks replay the recurrence from its inputs.
    step_states: bool = True
    # With step_states: a step's delta (1/Dk of its state) rather than its state, the rollback replaying
    # the kept updates (gated_delta.replay), bit-exact and less memory (docs/performance.md); where our
    # kernel does not run the layer (`gated_delta.replays_deltas`) the states still.
    step_deltas: bool = True
    cuda_matmul: bool = True  # the 4-bit small-M kernel and stacked bf16 GEMMs (matmul.py), else MLX's own
    bf16_stream: bool = True  # on CUDA, bf16 products of <= 32 rows in our stream kernel (bf16_matmul_cuda.py)
    one_launch_per_input: bool = True  # projections sharing an input in one launch, else one per weight
    # With bf16_stream and one_launch_per_input: each projection's output an array of its own from the
    # one launch, else columns of one product, which the reshapes after them copy (a launch each: 54
    # a Gemma 3 270M verify, 36 of the 54 gone; the drafts' too). Launches a cycle makes and a
    # target-alone step does not (docs/performance.md, "Fewer launches in the cycle").
    stream_parts: bool = True
    # on CUDA, a residual add and the RMS norms beside it in one launch (norms.py, residual_norm_cuda.py);
    # off: on an H100 with 33 % fewer launches it made no end-to-end difference above the noise
    # (docs/performance.md, "Fewer launches: Gemma's norm scales, fused residual norms")
    fused_norms: bool = False
    queue_layers: bool = True  # a decode/verify forward starts on the device as its first layers are built
    # A cycle followed by a cycle queues the next one's drafts behind its verify, from the acceptance
    # on the device, so that the device drafts while the host reads and builds the next verify
    # (Engine._launch); else the drafts are built after the read, the device idle meanwhile. None: on
    # a GPU, not on the CPU, where the device is the host's own cores. Measured: 6 % faster on an
    # H100, 6 % slower on a 2-core x86 CPU (docs/performance.md, "Drafts ahead and split outputs");
    # on for Metal by the same reasoning (a device beside the host's cores), not measured there.
    draft_ahead: Optional[bool] = None
    # Drafts over the drafter's draft vocabulary where it has one (draft_vocab.json, draft_vocab.py),
    # else over the whole LM head. None: on the CPU, where a large vocabulary's head is most of a
    # draft (the demo drafter's always-on 0.45x -> 0.54x the target on a 2-core x86 CPU, tokens a
    # cycle 2.61 -> 2.45), not on a GPU, where the head is a small part of a cycle the host's
    # launches bound and the tokens left out would cost acceptance (docs/performance.md, "A draft
    # vocabulary").
    draft_vocab: Optional[bool] = None
    # The drafter's layers in the engine's drafts as two compiled blocks each around attention
    # (drafter.py, `DrafterLayer.forward`), else op by op: the same ops, fewer for the host to build.
    compiled_drafter: bool = True
    cpu_half_head: bool = True  # on the CPU, a large float32 LM head as int8/float16 in our kernel (cpu_head.py)
    cpu_narrow_linears: bool = True  # on the CPU, a target's projections as int8/float16 copies in our primitive (cpu_linear.py)
    # on the CPU, attention's softmax and (<= 16 queries) its products in our primitives (cpu_softmax.cpp, cpu_attention.cpp)
    cpu_softmax: bool = True


DEFAULT_KERNELS = KernelOptions()
