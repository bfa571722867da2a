"""The attention of a target's decode steps and verify blocks on CUDA (dflash_core/kernels/
attention_cuda.py): which calls it takes; on a GPU, close to MLX's fused attention, a query row's
bits independent of the rows, batch rows and buffer length beside it, and every family's bf16
verify giving its tokens the logits of one-token steps to the bit, so that speculative output is the
target-alone output in bf16 too. (The wiring on this CPU, with a stand-in: test_lossless.py,
test_batched_forward.py.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import ENGINE_FAMILIES, MODEL_TYPES, sample_prompt
from forced import ForcedDrafter, verify_and_steps

from dflash_core.engine import Engine
from dflash_core.kernels import KernelOptions, attention_cuda, backend
from dflash_core.kernels import attention as attn
from dflash_core.kernels.attention import buffer_mask
from dflash_core.loading import load_engine

cuda_only = pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend (run on the GPU machine)")


def _qkv(B=1, heads=8, kv_heads=2, L=16, T=300, D=128, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, heads, L, D)).astype(dtype)
    k = mx.random.normal((B, kv_heads, T, D)).astype(dtype)
    v = mx.random.normal((B, kv_heads, T, D)).astype(dtype)
    return q, k, v


def test_gate(monkeypatch):
    q, k, v = _qkv()
    mask = mx.ones((16, 300), mx.bool_)
    assert attention_cuda.supported(q, k, v, mask) and attention_cuda.supported(q, k, v, None)
    assert attention_cuda.supported(q[:, :, :1], k, v, mask[:1])  # decode
    assert attention_cuda.supported(q, k, v, mx.ones((1, 1, 16, 300), mx.bool_))  # a batch's
    assert attention_cuda.supported(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), mask)
    assert not attention_cuda.supported(mx.concatenate([q, q[:, :, :1]], axis=2), k, v, None)  # 17 queries: a prefill
    assert not attention_cuda.supported(q[..., :48], k[..., :48], v[..., :48], None)  # head_dim 48
    assert not attention_cuda.supported(q, k.astype(mx.float16), v, None)  # mixed dtypes
    assert not attention_cuda.supported(q, k, v, mx.where(mask, 0.0, -mx.inf))  # an additive mask
    assert not attention_cuda.supported(q, k, v, mask[:, :299])  # a mask over other keys
    assert not attention_cuda.supported(q, k, v, mx.ones((1, 2, 16, 300), mx.bool_))  # per KV head: not a layout here
    assert not attention_cuda.supported(q, k, v, mx.ones((3, 1, 16, 300), mx.bool_))  # another batch
    assert not attention_cuda.supported(q, k, v, mx.ones((1, 16, 300), mx.bool_))  # 3-d: heads or batch?
    assert not attention_cuda.supported(q, k[:, :, :0], v[:, :, :0], None)  # no keys
    assert not attention_cuda.supported(q[:0], k, v, None)  # no rows
    assert not attention_cuda.supported(q[:, :7], k, v, None)  # 7 query heads over 2 KV heads
    assert not attention_cuda.supported(mx.concatenate([q, q]), mx.concatenate([k, k, k]), mx.concatenate([v, v, v]), None)
    # The engine's gate: CUDA, the option on, arrays (not a quantized cache's tuples).
    assert attn.exact(q, k, v, mask) == (backend() == "cuda")
    monkeypatch.setattr(attn, "backend", lambda: "cuda")
    assert attn.exact(q, k, v, mask)
    assert not attn.exact(q, k, v, mask, KernelOptions(exact_attention=False))
    assert not attn.exact(q, (k, k, k), (v, v, v), mask)
    assert "rows rounded alike" in attn.active_path()


def _reference(q, k, v, scale, mask):
    """MLX's fused attention in float32 over the same inputs."""
    f = [x.astype(mx.float32) for x in (q, k, v)]
    return mx.fast.scaled_dot_product_attention(*f, scale=scale, mask=mask)


SHAPES = [(4, 2, 16), (8, 2, 32), (4, 1, 64), (16, 4, 128), (16, 4, 256), (8, 1, 512)]  # heads, kv heads, D
CASES = ([(mx.bfloat16, *shape) for shape in SHAPES]
         + [(mx.float32, *shape) for shape in SHAPES if shape[2] in (64, 256)]
         + [(mx.float16, 16, 4, 128)])


@cuda_only
@pytest.mark.parametrize("dtype,heads,kv_heads,D", CASES)
@pytest.mark.parametrize("L,T", [(1, 50), (1, 1000), (5, 128), (16, 129), (16, 1300)])
def test_matches_mlx(dtype, heads, kv_heads, D, L, T):
    q, k, v = _qkv(2, heads, kv_heads, L, T, D, dtype)
    scale = D**-0.5
    start = T - L - 7 if T > L + 7 else 0  # a buffer's tail the queries do not see
    mask = buffer_mask(T, start, L)
    tol = {mx.bfloat16: 2e-2, mx.float16: 4e-3}.get(dtype, 1e-5)
    for m in (mask, None, mx.broadcast_to(mask, (2, 1, L, T))):
        got = attention_cuda.attention(q, k, v, scale, m)
        assert got.shape == q.shape and got.dtype == dtype
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(_reference(q, k, v, scale, m)),
                                   rtol=tol, atol=tol)


@cuda_only
@pytest.mark.parametrize("tensor_cores,chunk", [(True, 128), (False, 128), (True, 512), (True, 32), (False, 32),
                                                (True, 64)],
                         ids=["tensor-cores", "scalar", "tensor-cores-chunk512", "tensor-cores-chunk32", "scalar-chunk32",
                              "tensor-cores-chunk64"])
@pytest.mark.parametrize("D,kv_heads", [(128, 2), (256, 4), (512, 1)])
def test_a_query_gets_the_same_bits_alone_or_in_a_block(D, kv_heads, tensor_cores, chunk):
    """A verify's query over the cache's whole buffer (its tail masked) and the same query as a
    decode step over the keys written so far (a slice, no mask): the same bits, at positions on
    both sides of the chunk boundaries and in one-chunk buffers, with either kernel and chunk size."""
    T = 1024
    q, k, v = _qkv(1, 8, kv_heads, 16, T, D)
    scale = D**-0.5

    def attend(q, k, v, mask=None):
        return attention_cuda.attention(q, k, v, scale, mask, tensor_cores, chunk)

    for start in (0, 100, 120, 127, 250, 700):
        block = attend(q, k, v, buffer_mask(T, start, 16))
        longer = attend(q, mx.concatenate([k, k], axis=2), mx.concatenate([v, v], axis=2), buffer_mask(2 * T, start, 16))
        assert mx.array_equal(block, longer)
        for i in (0, 5, 15):
            seen = start + i + 1
            alone = attend(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen])
            assert mx.array_equal(alone[:, :, 0], block[:, :, i]), (start, i)


@cuda_only
@pytest.mark.parametrize("heads,kv_heads,L,T", [(4, 1, 1, 1000), (16, 4, 1, 1300), (16, 4, 16, 1300), (32, 2, 13, 700)],
                         ids=["270m-decode", "9b-decode", "9b-verify", "two-row-blocks"])
def test_loading_warps_change_no_bit(heads, kv_heads, L, T):
    """Warps that only load tiles (`load_warps`, KernelOptions.attention_load_warps) give the tensor-
    core kernel's outputs bit for bit, one computing warp or several, one row block or two (32 / 2
    heads x 13 queries: 208 rows), one chunk or many, with a mask and without."""
    for D in (128, 256):
        q, k, v = _qkv(1, heads, kv_heads, L, T, D, seed=D + L)
        for mask in (None, buffer_mask(T, T - L, L)):
            one = attention_cuda.attention(q, k, v, D**-0.5, mask, True, 128, 1)
            for warps in (2, 4, 8):
                assert mx.array_equal(attention_cuda.attention(q, k, v, D**-0.5, mask, True, 128, warps), one), warps
            short = attention_cuda.attention(q, k[:, :, :100], v[:, :, :100], D**-0.5, None, True, 128, 4)
            assert mx.array_equal(short, attention_cuda.attention(q, k[:, :, :100], v[:, :, :100], D**-0.5, None,
                                                                  True, 128, 1))


@cuda_only
@pytest.mark.parametrize("D", [64, 128, 256])
def test_tensor_cores_and_the_scalar_kernel_agree(D):
    """The tensor-core kernel rounds the probabilities to bf16 before their product with the values
    (as FlashAttention does), the scalar one keeps them in float32: the two agree within bf16's
    rounding, and the scalar-attention path of gpu_cycle.py measures the same attention."""
    q, k, v = _qkv(2, 16, 4, 16, 900, D, seed=5)
    mask = buffer_mask(900, 800, 16)
    cores = attention_cuda.attention(q, k, v, D**-0.5, mask, True)
    scalar = attention_cuda.attention(q, k, v, D**-0.5, mask, False)
    np.testing.assert_allclose(np.array(cores.astype(mx.float32)), np.array(scalar.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)


@cuda_only
def test_batch_rows_and_scattered_masks_round_alone():
    """Batch rows, each with its own mask (a ring's visible slots are scattered), give each row what
    it gets alone; a query among other queries what it gets with none."""
    B, T = 3, 700
    q, k, v = _qkv(B, 8, 2, 16, T, 256, seed=3)
    mask = mx.random.uniform(shape=(B, 1, 16, T)) < 0.6
    together = attention_cuda.attention(q, k, v, 0.0625, mask)
    for b in range(B):
        alone = attention_cuda.attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], 0.0625, mask[b : b + 1])
        assert mx.array_equal(alone, together[b : b + 1])
        for i in (0, 9):
            one = attention_cuda.attention(q[b : b + 1, :, i : i + 1], k[b : b + 1], v[b : b + 1], 0.0625,
                                           mask[b : b + 1, :, i : i + 1])
            assert mx.array_equal(one[:, :, 0], together[b, :, i][None])


# Tiny shapes whose every product the bf16 stream kernel takes (K a multiple of 32, N of 16), as the
# released models' are: the tiny defaults leave Qwen3.5's b and a projections 4 wide and Gemma 4's
# per-layer inputs 4 wide, which MLX's GEMM would round by the number of rows.
BF16_SHAPES = {"qwen3_5": {"linear_num_value_heads": 16}, "gemma4": {"hidden_size_per_layer_input": 32}}


def _bf16_engine(tiny_pair_factory, family):
    target, drafter = tiny_pair_factory(MODEL_TYPES[family], target_kwargs={"shape": BF16_SHAPES.get(family, {})})
    return load_engine(str(target), str(drafter), prefill_chunk=16, dtype="bfloat16")


@cuda_only
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_bf16_verify_is_single_steps_to_the_bit(tiny_pair_factory, family):
    """In bf16 on CUDA a 16-token verify gives each token the logits of 16 one-token steps to the
    bit, past the sliding windows."""
    engine = _bf16_engine(tiny_pair_factory, family)
    prompt = (sample_prompt(engine) * 8)[:100]
    verify, steps = verify_and_steps(engine.target, prompt, prompt[:16])
    assert np.array_equal(verify, steps)


@cuda_only
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_bf16_speculative_output_is_the_targets(tiny_pair_factory, family):
    """In bf16 on CUDA, speculative output equals target-alone output token for token: the random
    drafter, a forced one through every acceptance length 0..15, and seeded sampling."""
    from dflash_core.sampling import SamplingParams

    engine = _bf16_engine(tiny_pair_factory, family)
    prompt = sample_prompt(engine)
    n = 200

    def run(e, **kwargs):
        return [t for c in e.generate(prompt, max_tokens=n, stop_token_ids=set(), **kwargs) for t in c.token_ids]

    reference = run(engine, speculative=False)
    assert run(engine) == reference
    schedule = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8]
    forced = ForcedDrafter(list(prompt) + reference + [0] * 16, len(prompt), schedule, engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    assert run(Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)) == reference
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    assert run(engine, sampling=sampling) == run(engine, sampling=sampling, speculative=False)
