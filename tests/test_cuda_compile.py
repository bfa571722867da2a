"""Every CUDA kernel of ours compiles for the H100 and H200 (sm_90) with NVRTC, on a machine
without a GPU: each Python wrapper runs with `mx.fast.cuda_kernel` standing in, which builds the
source as MLX does (its generated signature, the template values and dtypes the wrapper really
passes) and compiles it instead of launching it. Compile errors then show here, not on the GPU
machine. MLX's own device header is represented by tests/cuda_stub (the parts our kernels use).
NVRTC and the CUDA headers come from the nvidia-cuda-nvrtc, -runtime and -cccl wheels (test
extras, Linux x86-64)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_core.kernels import (
    attention_cuda,
    attention_mma_cuda,
    bf16_matmul_cuda,
    gated_delta_cuda,
    quantized_matmul_cuda,
    residual_norm_cuda,
)


def _nvidia(relative: str):
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        if (Path(base) / relative).exists():
            return Path(base) / relative
    return None


NVRTC = _nvidia("cu13/lib/libnvrtc.so.13")
INCLUDE = _nvidia("cu13/include")
if not (NVRTC and INCLUDE and (INCLUDE / "cccl").exists()) and not os.environ.get("CI"):
    pytest.skip("no NVRTC 13 wheels here (pip install '.[test]' on Linux x86-64)", allow_module_level=True)

STUB = Path(__file__).parent / "cuda_stub"
CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.bool_: "bool",
              mx.uint32: "uint32_t", mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t"}
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


def build(name, header, source, input_names, inputs, output_names, output_dtypes, template) -> str:
    """The kernel source as mx.fast.cuda_kernel builds it (MLX 0.32, backend/cuda/custom_kernel.cpp)."""
    params = []
    for n, a in zip(input_names, inputs):
        params.append(f"    const {CUDA_TYPES[a.dtype]}* {n}")
        if a.ndim > 0:
            params += [f"    const __grid_constant__ Shape {n}_shape"] if f"{n}_shape" in source else []
            params += [f"    const __grid_constant__ Strides {n}_strides"] if f"{n}_strides" in source else []
            params += [f"    const __grid_constant__ int {n}_ndim"] if f"{n}_ndim" in source else []
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    constants = []
    for n, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {n} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {n} = {value};")
        else:
            constants.append(f"  using {n} = {CUDA_TYPES[value]};")
    return (DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + "\n".join(constants) + "\n\n"
            + source + "\n}\n\n} // namespace mlx::core::cu\n")


@functools.cache
def _nvrtc():
    return ctypes.CDLL(str(NVRTC))


def compile_sm90(source: str, name: str) -> str:
    """NVRTC's log; a failed compile fails the test with it."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    options = ["--gpu-architecture=sm_90", "-std=c++17", "-default-device", f"-I{STUB}", f"-I{INCLUDE}",
               f"-I{INCLUDE / 'cccl'}"]
    status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*[o.encode() for o in options]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode(errors="replace")
    numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))
    assert status == 0, f"{name} does not compile:\n{text}\n{numbered}"
    return text


class CompilingKernels:
    """Stands in for mx.fast.cuda_kernel: each call compiles the kernel (once per distinct source)
    and returns zeros of the output shapes."""

    def __init__(self):
        self.compiled: dict[str, tuple] = {}

    def __call__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):
        def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None,
                   verbose=False, stream=None):
            assert len(inputs) == len(input_names) and len(output_shapes) == len(output_names) == len(output_dtypes)
            assert 0 < threadgroup[0] * threadgroup[1] * threadgroup[2] <= 1024, threadgroup
            assert all(g > 0 for g in grid) and grid[1] <= 65535 * threadgroup[1] and grid[2] <= 65535 * threadgroup[2]
            full = "custom_kernel_" + name
            text = build(full, header, source, input_names, inputs, output_names, output_dtypes, template)
            if text not in self.compiled:
                compile_sm90(text, full)
                self.compiled[text] = (name, tuple(template))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


KERNEL_GETTERS = [attention_cuda._chunks_kernel, attention_cuda._combine_kernel, attention_mma_cuda.chunks_kernel,
                  bf16_matmul_cuda._kernel,
                  quantized_matmul_cuda._kernel, gated_delta_cuda._kernel, gated_delta_cuda._replay_kernel,
                  residual_norm_cuda._kernel]


@pytest.fixture
def kernels(monkeypatch):
    compiling = CompilingKernels()
    for getter in KERNEL_GETTERS:  # (cached kernel objects would bypass the stand-in)
        getter.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", compiling)
    yield compiling
    for getter in KERNEL_GETTERS:
        getter.cache_clear()


def _normal(*shape, dtype=mx.bfloat16):
    return mx.random.normal(shape).astype(dtype)


def test_attention_kernels_compile(kernels):
    """Decode and verify, one chunk and several (the combine kernel), with and without a mask, every
    head dim and dtype the gate takes."""
    for dtype, D in [(mx.bfloat16, 16), (mx.bfloat16, 128), (mx.bfloat16, 256), (mx.bfloat16, 512),
                     (mx.float16, 128), (mx.float32, 64)]:
        for L, T in [(1, 100), (16, 1000)]:
            q, k, v = _normal(1, 8, L, D, dtype=dtype), _normal(1, 2, T, D, dtype=dtype), _normal(1, 2, T, D, dtype=dtype)
            for mask in (None, mx.ones((L, T), mx.bool_)):
                assert attention_cuda.supported(q, k, v, mask)
                assert attention_cuda.attention(q, k, v, D**-0.5, mask).shape == q.shape
    # The scalar kernel for bf16 too (`KernelOptions.tensor_core_attention` off: gpu_cycle.py's
    # scalar-attention path).
    count = len(kernels.compiled)
    q, k, v = _normal(1, 8, 16, 128), _normal(1, 2, 1000, 128), _normal(1, 2, 1000, 128)
    assert attention_cuda.attention(q, k, v, 128**-0.5, mx.ones((16, 1000), mx.bool_), False).shape == q.shape
    assert len(kernels.compiled) > count
    # Warps that only load tiles (`KernelOptions.attention_load_warps`, gpu_cycle.py's load-warps4 path).
    count = len(kernels.compiled)
    q1 = _normal(1, 4, 1, 256)
    k1, v1 = _normal(1, 1, 1000, 256), _normal(1, 1, 1000, 256)
    assert attention_cuda.attention(q1, k1, v1, 256**-0.5, None, True, 128, 4).shape == q1.shape
    assert len(kernels.compiled) > count
    # 512 and 32 key slots per block (`KernelOptions.attention_chunk`, gpu_cycle.py's chunk512 and
    # chunk32 paths), on either kernel.
    for chunk, tensor_cores in [(512, True), (32, True), (32, False)]:
        count = len(kernels.compiled)
        assert attention_cuda.attention(q, k, v, 128**-0.5, mx.ones((16, 1000), mx.bool_), tensor_cores,
                                        chunk).shape == q.shape
        assert len(kernels.compiled) > count
    with pytest.raises(ValueError, match="multiple of 32"):
        attention_cuda.attention(q, k, v, 128**-0.5, None, True, 100)
    names = {name for name, _ in kernels.compiled.values()}
    # bf16 and fp16 up to head dim 256 on tensor cores; 512 and float32 on the scalar kernel
    assert names == {"dflash_attention_mma_chunks", "dflash_attention_chunks", "dflash_attention_combine"}
    assert len(kernels.compiled) >= 20


def test_matmul_kernels_compile(kernels):
    x = _normal(16, 1024)
    for M, N in [(1, 256), (9, 1024), (32, 4096)]:
        assert bf16_matmul_cuda.supported(M, x[:M], _normal(N, 1024))
        assert bf16_matmul_cuda.matmul_stream(x[:M] if M <= 16 else _normal(M, 1024), _normal(N, 1024)).shape == (M, N)
    # A stacked weight's parts (q, k, v; gate, up) as outputs of their own.
    for splits in ((512,), (512, 768), (256, 512, 768)):
        w = _normal(1024, 1024)
        assert bf16_matmul_cuda.parts_supported(w, splits)
        for M in (1, 16):
            outs = bf16_matmul_cuda.matmul_stream_parts(x[:M], w, splits)
            bounds = [0, *splits, 1024]
            assert [o.shape for o in outs] == [(M, b - a) for a, b in zip(bounds, bounds[1:])]
    assert not bf16_matmul_cuda.parts_supported(_normal(1024, 1024), (520,))
    assert not bf16_matmul_cuda.parts_supported(_normal(1024, 1024), (512, 512))
    for parts in (1, 2, 3, 4):  # (q, k, v; gate, up: the weights that share an input go in one launch)
        weights = [mx.quantize(_normal(n, 1024), group_size=64, bits=4) for n in (512, 256, 256, 48)[:parts]]
        for M in (1, 16):
            outs = quantized_matmul_cuda.quantized_matmuls_cuda(x[:M], [tuple(w) for w in weights], 64)
            assert [o.shape for o in outs] == [(M, w[0].shape[0]) for w in weights]
    names = {name for name, _ in kernels.compiled.values()}
    assert names == ({"dflash_small_m_stream"} | {f"dflash_small_m_stream_parts{parts}" for parts in (2, 3, 4)}
                     | {f"dflash_q4_small_m_matmul_{parts}" for parts in (1, 2, 3, 4)})


def test_gated_delta_kernels_compile(kernels):
    B, T, Hk, Hv, Dk, Dv = 1, 16, 2, 4, 128, 128
    q, k, v = _normal(B, T, Hk, Dk), _normal(B, T, Hk, Dk), _normal(B, T, Hv, Dv)
    g, beta = _normal(B, T, Hv), _normal(B, T, Hv)
    state = mx.zeros((B, Hv, Dv, Dk), mx.float32)
    assert gated_delta_cuda.supported(q, v, g)
    for options in ({}, {"step_states": True}, {"deltas": True}):
        outs = gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, **options)
        assert outs[0].shape == (B, T, Hv, Dv) and outs[1].shape == state.shape
    deltas = mx.zeros((B, T, Hv, Dv), mx.float32)
    assert gated_delta_cuda.replay_cuda(k, g, deltas, state, mx.array([5], mx.int32)).shape == state.shape
    names = {name for name, _ in kernels.compiled.values()}
    assert names == {"dflash_gated_delta", "dflash_gated_delta_step_states", "dflash_gated_delta_deltas",
                     "dflash_gated_delta_replay"}


def test_residual_norm_kernels_compile(kernels):
    """Every form (add then norm; a normed branch added, then a norm; a normed branch added alone) in
    bf16 and float32, for a 270M's rows and a 27B's."""
    for dtype in (mx.bfloat16, mx.float32):
        for D in (640, 4096, 5376):
            h, r, w = _normal(16, D, dtype=dtype), _normal(16, D, dtype=dtype), _normal(D, dtype=dtype)
            assert residual_norm_cuda.supported(h, r, w)
            assert [o.shape for o in residual_norm_cuda.residual_norm(h, r, w, 1e-6)] == [(16, D)] * 2
            assert len(residual_norm_cuda.residual_norm(h, r, w, 1e-6, w, 1e-6)) == 2
            assert len(residual_norm_cuda.residual_norm(h[:1], r[:1], None, 0.0, w, 1e-6)) == 1
    assert {name for name, _ in kernels.compiled.values()} == {"dflash_residual_norm", "dflash_residual_add"}
    assert len(kernels.compiled) == 18
