"""Load a target (any mlx-lm checkpoint of a supported family) and its DFlash drafter."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm import utils as mlx_lm_utils

from .adapters import TargetAdapter, adapter_for
from .drafter import DFlashDrafter, load_drafter
from .engine import Engine
from .hub import DRAFTER_FILES, TARGET_FILES, resolve
from .kernels.cpu_extension import build_in_background
from .prefix_cache import PrefixCache, SnapshotBudget
from .registry import find_pair
from .sharding import shard_target
from .warm_up import warm_up as run_warm_up

log = logging.getLogger(__name__)

# Measured on this project's x86-64 CPU with benchmarks/cpu_matmul.py (docs/train.md): MLX's CPU
# backend multiplies a 16-row matrix in 16 times the time of one row, where a GPU or Metal reads
# the weights once.
CPU_SPECULATION_WARNING = (
    "running on MLX's CPU backend: its matrix multiply costs about as much per row as a one-row "
    "decode step, so verifying a 16-token block costs about 16 decode steps and DFlash is usually "
    "SLOWER than the target alone here (output is identical either way), and speculation is 'on'. "
    "With 'auto' (the default) cycles run only while they beat plain target steps on this machine; "
    "DFlash pays off on a GPU or Apple silicon."
)

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def load_target(path: Path, *, dtype: Optional[str] = None, quantize_bits: Optional[int] = None,
                quantize_group_size: int = 64, group=None) -> tuple[TargetAdapter, object, dict]:
    """`group`: an `mx.distributed` group to shard the target over (tensor parallelism,
    distributed.py); each rank then holds its share of the weights."""
    model, config = mlx_lm_utils.load_model(Path(path))
    if dtype is not None:
        cast_floating(model, DTYPES[dtype])
    if quantize_bits is not None:
        if "quantization" in config:
            raise ValueError(f"{path}: already quantized ({config['quantization']}); remove quantize_bits")
        nn.quantize(model, group_size=quantize_group_size, bits=quantize_bits,
                    class_predicate=quantizable(model, quantize_group_size))
    mx.eval(model.parameters())
    if group is not None:
        whole = parameter_bytes(model)
        shard_target(model, group)
        log.info("rank %d of %d: %.1f MB of the target's weights here (%.1f MB unsharded)", group.rank(),
                 group.size(), parameter_bytes(model) / 1e6, whole / 1e6)
    text_config = config.get("text_config") or {}
    eos = config.get("eos_token_id", text_config.get("eos_token_id"))
    if isinstance(eos, int):
        eos = [eos]
    tokenizer = mlx_lm_utils.load_tokenizer(Path(path), eos_token_ids=eos)
    return adapter_for(model), tokenizer, config


def cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast the floating-point weights to `dtype`, except those mlx-lm's `cast_predicate` names
    (GatedDeltaNet's A_log stays float32); packed quantized weights and other integers stay."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda path, v: v.astype(dtype) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def parameter_bytes(*modules: Optional[nn.Module]) -> int:
    """Bytes of the modules' parameters (None: no module)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for m in modules if m is not None for _, v in tree_flatten(m.parameters()))


def quantizable(model: nn.Module, group_size: int):
    """nn.quantize's class_predicate: layers that can be quantized at this group size, as far as the
    model's own `quant_predicate` (where it has one) allows."""
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        return model_predicate(path, module) if model_predicate else True

    return predicate


def load_checked_drafter(path: Path, target: TargetAdapter, block_size: Optional[int] = None) -> DFlashDrafter:
    drafter = load_drafter(path, dtype=target.dtype, kernels=target.kernels)
    drafter.config.check_target(
        str(Path(path) / "config.json"),
        hidden_size=target.hidden_size,
        num_layers=target.num_layers,
        vocab_size=target.vocab_size,
    )
    if block_size is not None:
        if not 2 <= block_size <= drafter.config.block_size:
            raise ValueError(
                f"block_size {block_size}: must be between 2 and the drafter's trained block size "
                f"{drafter.config.block_size}"
            )
        drafter.config.block_size = block_size
    return drafter


def max_position_embeddings(config: dict) -> Optional[int]:
    text_config = config.get("text_config") or {}
    return config.get("max_position_embeddings", text_config.get("max_position_embeddings"))


@dataclass
class LoadedModel:
    engine: Engine
    target_path: Path
    drafter_path: Optional[Path]
    config: dict
    # Sampling defaults the model's authors ship in generation_config.json.
    generation_defaults: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Weights in memory: the target's and the drafter's."""
        return parameter_bytes(self.engine.target.model, self.engine.drafter)


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: Path) -> dict:
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    raw = json.loads(file.read_text())
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: raw[k] for k in GENERATION_DEFAULT_KEYS if raw.get(k) is not None}


def choose_drafter(target: str, drafter: Optional[str], drafter_revision: Optional[str]):
    """(drafter, revision, why speculation is off). `drafter="auto"` asks the registry."""
    if drafter == "auto":
        pair = find_pair(target)
        if pair is None:
            reason = f"no known DFlash drafter for {target}: serving the target alone"
            log.warning(reason)
            return None, None, reason
        log.info("drafter for %s: %s (registry)", target, pair.drafter)
        return pair.drafter, drafter_revision or pair.drafter_revision, None
    if not drafter:
        return None, None, "no drafter configured"
    return drafter, drafter_revision, None


def inexact_attention_note(adapter: TargetAdapter) -> Optional[str]:
    """On CUDA, why this target's verifies may round a token differently from a decode step: head
    dims the exact attention kernel does not take (kernels/attention_cuda.py), which then attend
    through MLX's paths. None when there is nothing to say."""
    from .kernels import attention_cuda, backend

    if backend() != "cuda" or not adapter.kernels.exact_attention:
        return None
    args = adapter.text_model.args
    dims = {getattr(args, name, None) for name in ("head_dim", "global_head_dim")} - {None}
    if not (outside := sorted(d for d in dims if d not in attention_cuda.HEAD_DIMS)):
        return None
    return (f"attention head_dim {', '.join(map(str, outside))} is not one the exact CUDA attention takes "
            f"({', '.join(map(str, attention_cuda.HEAD_DIMS))}): those layers attend through MLX's kernels, so at a "
            "near-tie a verify can round a token differently from a decode step and speculative output can part "
            "from the target-alone output")


def load_model(
    target: str,
    drafter: Optional[str] = "auto",
    *,
    target_revision: Optional[str] = None,
    drafter_revision: Optional[str] = None,
    prefill_chunk: int = 2048,
    prefill_seconds: Optional[float] = None,
    max_context: Optional[int] = None,
    block_size: Optional[int] = None,
    dtype: Optional[str] = None,
    quantize_bits: Optional[int] = None,
    prefix_cache: Union[int, SnapshotBudget] = 0,
    speculation: str = "on",
    group=None,
    warm_up: Optional[bool] = None,
) -> LoadedModel:
    """`prefix_cache`: a byte budget of its own (0: no prefix cache) or a budget shared with other
    models' caches. `group`: shard the target over this `mx.distributed` group (distributed.py);
    prefill chunks are then of fixed size and the prefix cache counts nominal bytes, so that every
    rank makes the same choices. `warm_up`: run the forwards once now (warm_up.py); None: on a
    GPU, where the first use of each kernel variant compiles it. Not on a sharded target, whose
    forwards need every rank."""
    if group is not None:
        prefill_seconds = None
    build_in_background()  # our CPU kernels compile (a first run) while the weights load
    drafter, drafter_revision, off_reason = choose_drafter(target, drafter, drafter_revision)
    target_path = resolve(target, target_revision, files=TARGET_FILES)
    adapter, tokenizer, config = load_target(target_path, dtype=dtype, quantize_bits=quantize_bits, group=group)
    draft_model, drafter_path = None, None
    if drafter:
        drafter_path = resolve(drafter, drafter_revision, files=DRAFTER_FILES)
        draft_model = load_checked_drafter(drafter_path, adapter, block_size)
        if mx.default_device() == mx.cpu and speculation == "on":
            log.warning(CPU_SPECULATION_WARNING)
        if (note := inexact_attention_note(adapter)) is not None:
            log.warning(note)
    engine = Engine(
        adapter,
        tokenizer,
        draft_model,
        prefill_chunk=prefill_chunk,
        prefill_seconds=prefill_seconds,
        max_context=max_context or max_position_embeddings(config),
        drafter_off_reason=off_reason,
        prefix_cache=PrefixCache(prefix_cache, measured=group is None) if _budget_bytes(prefix_cache) > 0 else None,
        speculation=speculation,
    )
    if group is not None:
        if warm_up:
            log.warning("warm_up is not run for a sharded target: its forwards need every rank")
    elif warm_up if warm_up is not None else mx.default_device() != mx.cpu:
        _warm_up(engine, target)
    return LoadedModel(engine, target_path, drafter_path, config, generation_defaults(target_path))


def _warm_up(engine: Engine, target: str) -> None:
    """`warm_up.warm_up`, said in the log; a failure there is logged, not raised: the model serves
    (its first requests then compile what the warm-up did not)."""
    try:
        seconds = run_warm_up(engine)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimization; serving must not depend on it
        log.warning("warming up %s failed (%s: %s); kernels will compile in its first requests",
                    target, type(e).__name__, e)
        return
    if seconds is None:
        log.info("no warm-up for %s: its context is too short", target)
    else:
        log.info("warmed up %s in %.1f s (kernels compile on first use)", target, seconds)


def _budget_bytes(budget: Union[int, SnapshotBudget]) -> int:
    return budget.budget_bytes if isinstance(budget, SnapshotBudget) else budget


def load_configured(spec, prefill_chunk: int = 2048, prefix_cache: Union[int, SnapshotBudget] = 0,
                    prefill_seconds: Optional[float] = None, group=None) -> LoadedModel:
    """Load a `settings.ModelSettings` entry."""
    return load_model(
        spec.target,
        spec.drafter,
        target_revision=spec.target_revision,
        drafter_revision=spec.drafter_revision,
        prefill_chunk=prefill_chunk,
        prefill_seconds=prefill_seconds,
        max_context=spec.max_context,
        block_size=spec.block_size,
        dtype=spec.dtype,
        quantize_bits=spec.quantize_bits,
        prefix_cache=prefix_cache,
        speculation=spec.speculation,
        group=group,
        warm_up=spec.warm_up,
    )


def load_engine(target: str, drafter: Optional[str] = None, **kwargs) -> Engine:
    return load_model(target, drafter, **kwargs).engine
