"""A DFlash drafter checkpoint's config.json (z-lab `DFlashDraftModel`): what it says, read and
checked, with errors that name the file and the key; where a drafter taps its target when the
checkpoint names no layers; and the held-out acceptance its `dflash train` report measured.
Layouts: docs/formats.md.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("DFlashDraftModel",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message names the file and the key."""


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    rope_theta: float
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 262144
    layer_types: list[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    causal_override: Optional[bool] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    attention_bias: bool = False
    num_target_layers: Optional[int] = None

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def is_causal(self, layer: int) -> bool:
        # Precedence: top-level is_causal, then dflash_config.causal, then "sliding means causal".
        if self.causal_override is not None:
            return self.causal_override
        return self.is_sliding(layer)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "DrafterConfig":
        """Parse both z-lab layouts (old: top-level block_size/rope_theta; new: dflash_config and
        rope_parameters). Every missing or inconsistent key raises a CheckpointError naming it."""

        def fail(key: str, problem: str):
            raise CheckpointError(f"{source}: {key}: {problem}")

        archs = raw.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            fail(
                "architectures",
                f"{unknown[0]!r} is not supported (this build serves {SUPPORTED_ARCHITECTURES[0]} "
                "drafters only; DFlash2-style drafters are a different design)",
            )
        dcfg = raw.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            fail("dflash_config", "must be an object")

        def required(key: str) -> Any:
            if key not in raw:
                fail(key, "is missing")
            return raw[key]

        hidden = int(required("hidden_size"))
        n_layers = int(required("num_hidden_layers"))
        n_heads = int(required("num_attention_heads"))
        n_kv = int(raw.get("num_key_value_heads", n_heads))
        head_dim = int(raw.get("head_dim") or hidden // n_heads)

        def pick(key: str, default: Any = None) -> Any:
            # New layout keeps DFlash keys under dflash_config; old checkpoints at top level.
            if key in dcfg:
                return dcfg[key]
            return raw.get(key, default)

        mask_token_id = pick("mask_token_id")
        if mask_token_id is None:
            fail("dflash_config.mask_token_id", "is missing (the drafter cannot build its block without it)")
        block_size = int(pick("block_size", 16))
        if block_size < 2:
            fail("dflash_config.block_size", f"must be at least 2, got {block_size}")

        num_target_layers = pick("num_target_layers")
        taps = pick("target_layer_ids")
        if taps is None:
            if num_target_layers is None:
                fail("dflash_config.target_layer_ids", "is missing and num_target_layers is not given")
            taps = default_target_layer_ids(int(num_target_layers), n_layers)
        taps = [int(t) for t in taps]
        if not taps or any(t < 0 for t in taps):
            fail("dflash_config.target_layer_ids", f"must be non-negative layer ids, got {taps}")

        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta"))
        if rope_theta is None:
            fail("rope_theta", "is missing (neither top-level rope_theta nor rope_parameters.rope_theta)")
        rope_scaling = raw.get("rope_scaling") or (rope_params or None)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if "type" not in rope_scaling and "rope_type" in rope_scaling:
                rope_scaling["type"] = rope_scaling["rope_type"]

        layer_types = raw.get("layer_types")
        use_swa = bool(dcfg.get("use_swa", False))
        if layer_types is None:
            layer_types = ["sliding_attention" if use_swa else "full_attention"] * n_layers
        if len(layer_types) != n_layers:
            fail("layer_types", f"has {len(layer_types)} entries for {n_layers} layers")
        for t in layer_types:
            if t not in ("full_attention", "sliding_attention"):
                fail("layer_types", f"unknown layer type {t!r}")
        window = dcfg.get("swa_window_size") or raw.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            fail("sliding_window", "is missing but layer_types has sliding_attention layers")

        causal = raw.get("is_causal")
        if causal is None:
            causal = dcfg.get("causal", dcfg.get("is_causal"))

        softcap = pick("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(required("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=int(required("vocab_size")),
            block_size=block_size,
            target_layer_ids=taps,
            mask_token_id=int(mask_token_id),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 262144)),
            layer_types=list(layer_types),
            sliding_window=int(window) if window else None,
            causal_override=None if causal is None else bool(causal),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
        )

    def check_target(self, source: str, *, hidden_size: int, num_layers: int, vocab_size: int):
        """Refuse a drafter that does not fit the target instead of serving garbage drafts."""
        if self.hidden_size != hidden_size:
            raise CheckpointError(
                f"{source}: hidden_size: drafter has {self.hidden_size}, target has {hidden_size}"
            )
        bad = [t for t in self.target_layer_ids if t >= num_layers]
        if bad:
            raise CheckpointError(
                f"{source}: dflash_config.target_layer_ids: {bad} outside the target's "
                f"{num_layers} layers (0..{num_layers - 1})"
            )
        if self.vocab_size != vocab_size:
            raise CheckpointError(
                f"{source}: vocab_size: drafter has {self.vocab_size}, target has {vocab_size}"
            )
        if not 0 <= self.mask_token_id < vocab_size:
            raise CheckpointError(
                f"{source}: dflash_config.mask_token_id: {self.mask_token_id} is outside the "
                f"vocabulary (size {vocab_size})"
            )


def default_target_layer_ids(num_target_layers: int, num_taps: Optional[int] = None) -> list[int]:
    """Taps spread over the target when a checkpoint (or `dflash train`) names none: z-lab's
    round(1 + j * (n - 4) / (k - 1)), 5 taps by default; targets under 12 layers (the tests') get
    2-3 distinct ones, at most the last layer."""
    n = num_target_layers
    k = num_taps or (5 if n >= 12 else 2 if n <= 4 else 3)
    if k == 1:
        return [n // 2]
    span = max(n - 4, k - 1)
    return [min(n - 1, int(round(1 + j * span / (k - 1)))) for j in range(k)]


@dataclass(frozen=True)
class HeldOutAcceptance:
    """What `dflash train` measured of a drafter on held-out sequences (`acceptance_by_position` of
    the train_report.json in its directory, `source`): per block position 1.., the share of cycles
    whose drafts were all accepted through it."""

    through: tuple[float, ...]
    source: str


def read_held_out_acceptance(path: Path, positions: int) -> Optional[HeldOutAcceptance]:
    """The `HeldOutAcceptance` in a drafter directory, of at most `positions` positions. None where
    the directory has no report (z-lab's checkpoints) or one that does not say it; a report that
    says it wrongly is a warning naming the file and key, not an error: a drafter serves without it."""
    report = path / "train_report.json"
    if not report.is_file():
        return None
    try:
        values = json.loads(report.read_text()).get("acceptance_by_position")
    except (OSError, ValueError, AttributeError) as e:
        log.warning("%s: not a readable report (%s); its held-out acceptance is not used", report, e)
        return None
    if not values:  # (absent, or empty: a run whose held-out walk made no cycle)
        return None
    if (not isinstance(values, list) or not 0 < len(values) <= positions
            or not all(isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1 for v in values)
            or any(b > a for a, b in zip(values, values[1:]))):
        log.warning("%s: acceptance_by_position: expected at most %d shares in [0, 1], none above the one "
                    "before it; not used", report, positions)
        return None
    return HeldOutAcceptance(tuple(float(v) for v in values), str(report))
