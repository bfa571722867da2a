"""Shared fixtures: tiny random target/drafter pairs, built once per session."""

import os

# MLX's bundled reference BLAS, not the fast one `dflash` loads (tests/test_blas.py checks that):
# its float32 products round a row the same whatever the other rows, so a 16-token verify and a
# 1-token step agree to the bit and the lossless tests can demand exact equality. (The engine's
# own CPU kernels keep that true with MKL too: tests/test_blas.py runs the lossless checks with it.)
import mlx.core as mx
import pytest
from families import ENGINE_FAMILIES, FIXTURE_NAMES
from synthetic import tiny_pair

# The suite runs on the default device, so on a GPU machine the accelerator paths (our CUDA
# kernels, mlx-lm's Metal ones) face the same lossless tests. DFLASH_TEST_DEVICE=cpu forces the CPU.
if os.environ.get("DFLASH_TEST_DEVICE") == "cpu":
    mx.set_default_device(mx.cpu)
# The test models are float32: on CUDA, keep their matmuls float32 rather than TF32, whose rounding
# depends on the number of rows (a 16-row verify and a 1-row decode would then differ).
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def _pair_fixture(name: str, family: str):
    """A session fixture `{name}_pair`: the family's tiny (target_dir, drafter_dir)."""

    @pytest.fixture(scope="session", name=f"{name}_pair")
    def pair(tmp_path_factory):
        return tiny_pair(tmp_path_factory.mktemp(family), family)

    return pair


# qwen3_pair, qwen3_5_pair, qwen3_5_moe_pair, gemma4_pair, gemma3_pair: one per family.
for _family, _name in FIXTURE_NAMES.items():
    globals()[f"{_name}_pair"] = _pair_fixture(_name, _family)


@pytest.fixture(scope="session")
def gemma4_moe_pair(tmp_path_factory):
    """Gemma 4's tiny pair with its MoE block (router and experts) in every layer."""
    from families import GEMMA4_MOE

    return tiny_pair(tmp_path_factory.mktemp("gemma4_moe"), "gemma4", target_kwargs={"config_overrides": GEMMA4_MOE})


@pytest.fixture(scope="module")
def engines(request):
    """family -> an Engine over that family's tiny pair, prefilling in 16-token chunks."""
    from dflash_core.loading import load_engine

    loaded = {}
    for family in ENGINE_FAMILIES:
        target, drafter = request.getfixturevalue(f"{family}_pair")
        loaded[family] = load_engine(str(target), str(drafter), prefill_chunk=16)
    return loaded


@pytest.fixture
def tiny_pair_factory(tmp_path_factory):
    """callable(family, **drafter_kwargs) -> (target_dir, drafter_dir) in a fresh dir."""

    def build(family, **drafter_kwargs):
        return tiny_pair(tmp_path_factory.mktemp(f"{family}_pair"), family, **drafter_kwargs)

    return build


@pytest.fixture(scope="session")
def gemma3_text_pair(gemma3_pair):
    """The same pair under its model type (tests that iterate over dflash_core.shapes.FAMILIES)."""
    return gemma3_pair


@pytest.fixture
def stack_lookups(monkeypatch):
    """A list that gets, for every multi-layer call of `linears` on the CUDA path, whether the layers
    were found stacked (kernels/matmul.py), in call order."""
    from dflash_core.kernels import matmul

    found, products = [], matmul._stacked_products

    def recorded(layers, x, *options):
        ys = products(layers, x, *options)
        found.append(ys is not None)
        return ys

    monkeypatch.setattr(matmul, "_stacked_products", recorded)
    return found


@pytest.fixture(scope="session")
def cpu_kernels():
    """This project's compiled CPU extension (dflash_core/kernels/cpu_extension.py); CI must build
    it (a skip there would hide a broken build)."""
    from dflash_core.kernels import cpu_extension

    if cpu_extension.extension() is None:
        if os.environ.get("CI"):
            pytest.fail("the CPU kernels did not build in CI (a C++ compiler, CMake and nanobind are needed)")
        pytest.skip("no x86-64 Linux with AVX2/FMA/F16C, C++ compiler, CMake or nanobind here")
    return cpu_extension.extension()


@pytest.fixture
def exact_attention_calls(monkeypatch):
    """The attention gate as on CUDA (kernels/attention.py): a target's decode steps and verify
    blocks go to the exact kernel (kernels/attention_cuda.py). Without a GPU its stand-in is the
    CPU's own fixed-order attention (`attention.unfused_cpu`, also exact per row). Returns the
    query count of every call, in order."""
    from dflash_core.kernels import attention, attention_cuda, backend

    calls = []
    if backend() == "cuda":
        kernel = attention_cuda.attention
    else:  # (the kernel's options, tensor cores and chunk, mean nothing to the stand-in)
        def kernel(q, k, v, scale, mask=None, *options):
            return attention.unfused_cpu(q, k, v, scale, mask)
    monkeypatch.setattr(attention, "backend", lambda: "cuda")
    monkeypatch.setattr(attention_cuda, "attention", lambda q, k, v, scale, mask=None, *options:
                        calls.append(q.shape[2]) or kernel(q, k, v, scale, mask, *options))
    return calls


@pytest.fixture
def step_states(monkeypatch):
    """Rollbacks that pick one of the GatedDeltaNet states a verify recorded after every step
    (`KernelOptions.step_states` with `step_deltas` off), on any backend: returns adapter -> that
    adapter with the option."""
    from dataclasses import replace

    from dflash_core.adapters import qwen3_5

    monkeypatch.setattr(qwen3_5, "records_step_states", lambda: True)
    return lambda adapter: adapter.with_kernels(replace(adapter.kernels, step_deltas=False))


@pytest.fixture
def step_deltas(monkeypatch):
    """Rollbacks that replay recorded GatedDeltaNet deltas (`KernelOptions.step_deltas`, CUDA's
    default), with the pure-MLX recurrence on the uncompiled steps whose roundings a replay repeats
    (`gated_delta.reference_steps`): returns adapter -> that adapter with the option on."""
    from dataclasses import replace

    from dflash_core.adapters import qwen3_5
    from dflash_core.kernels import gated_delta

    monkeypatch.setattr(qwen3_5, "records_step_states", lambda: True)
    monkeypatch.setattr(qwen3_5, "replays_deltas", lambda head_k_dim, head_v_dim: True)
    monkeypatch.setattr(gated_delta, "reference", gated_delta.reference_steps)
    return lambda adapter: adapter.with_kernels(replace(adapter.kernels, step_deltas=True))
