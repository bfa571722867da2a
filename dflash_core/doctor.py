"""What `dflash doctor` and `dflash models` report about this machine and its models."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Optional

import mlx.core as mx

from . import draft_vocab
from .blas import describe as describe_blas
from .kernels import attention, backend, cpu_head, cpu_linear, gated_delta, matmul, norms
from .registry import KNOWN_PAIRS, find_pair
from .settings import Settings

CPU_SPECULATION = ("MLX's CPU backend: a verify costs about as many decode steps as it has tokens, so DFlash "
                   "cycles often lose here; speculation 'auto' (the default) runs them only while they beat "
                   "plain target steps, measured on this machine")


def package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_reachable(timeout: float = 3.0) -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode (HF_HUB_OFFLINE is set)"
    import httpx

    try:
        httpx.head(constants.ENDPOINT, timeout=timeout, follow_redirects=True)
        return f"reachable ({constants.ENDPOINT})"
    except httpx.HTTPError as e:
        return f"unreachable ({constants.ENDPOINT}: {type(e).__name__}); local models and the cache still work"


def system_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_model_status(settings: Settings, hub: str) -> str:
    """Where `dflash serve` gets its default model from, or that the demo will stand in for it."""
    from .demo import DEMO_NAME
    from .hub import TARGET_FILES, ModelNotFoundError, resolve

    spec = settings.model()
    try:
        resolve(spec.target, spec.target_revision, files=TARGET_FILES, allow_download=False)
        return f"{spec.name}: {spec.target} is on disk"
    except ModelNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a report, not a load: say what went wrong
        return f"{spec.name}: {type(e).__name__}: {e}"
    if hub.startswith("reachable"):
        return f"{spec.name}: not on disk yet; `dflash serve` downloads {spec.target} from the hub at start"
    if not settings.demo_fallback or spec.name == DEMO_NAME:
        return f"{spec.name}: not on disk and the hub is {hub.split(' (')[0]}: it cannot be served"
    return (f"{spec.name}: not on disk and the hub is {hub.split(' (')[0]}: `dflash serve` will serve the "
            f"OFFLINE DEMO {DEMO_NAME} instead")


def doctor_report(check_hub: bool = True, settings: Optional[Settings] = None) -> dict:
    from .demo import cache_root

    info = mx.device_info()
    memory = system_memory_bytes()
    hub = hub_reachable() if check_hub else "not checked"
    # The CPU's memory is the system's; MLX reports none for it.
    device_memory = info.get("memory_size") or (memory if mx.default_device() == mx.cpu else None)
    report = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": package_version("mlx"),
        "mlx-lm": package_version("mlx-lm"),
        "dflash": package_version("dflash"),
        "backend": backend(),
        "default_device": str(mx.default_device()),
        "device": info.get("device_name", "unknown"),
        "system_memory_gb": round(memory / 1e9, 1) if memory else None,
        "device_memory_gb": round(device_memory / 1e9, 1) if device_memory else None,
        "blas": describe_blas(),
        "kernels": {"gated_delta": gated_delta.active_path(), "block_attention": attention.active_path(),
                    "small_m_matmul": matmul.active_path(), "cpu_lm_head": cpu_head.active_path(),
                    "cpu_projections": cpu_linear.active_path(), "residual_norms": norms.active_path(),
                    "draft_vocab": draft_vocab.active_path()},
        "model_cache": str(hub_cache_dir()),
        "demo_cache": str(cache_root()),
        "hub": hub,
        "speculation": (CPU_SPECULATION if mx.default_device() == mx.cpu
                        else "a 16-token verify streams the weights once, as DFlash needs"),
    }
    if settings is not None:
        report["default_model"] = default_model_status(settings, hub) if check_hub else (
            f"{settings.model().name} (not checked: --no-hub)")
    return report


def cached_repos() -> dict[str, int]:
    """Repo id -> bytes on disk, for everything in the Hugging Face cache."""
    try:
        from huggingface_hub import scan_cache_dir

        return {repo.repo_id: repo.size_on_disk for repo in scan_cache_dir().repos}
    except Exception:  # no cache directory yet
        return {}


def _local_size(name: str, cache: dict[str, int]) -> Optional[int]:
    path = Path(name).expanduser()
    if path.exists():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return cache.get(name)


def models_report(settings: Settings) -> list[dict]:
    cache = cached_repos()
    rows = []
    for m in settings.models:
        drafter = m.drafter
        if drafter == "auto":  # what the registry will pick, so its download shows too
            pair = find_pair(m.target)
            drafter = pair.drafter if pair else None
        rows.append({"source": "config", "name": m.name, "target": m.target, "drafter": drafter,
                     "target_bytes": _local_size(m.target, cache),
                     "drafter_bytes": _local_size(drafter, cache) if drafter else None})
    from .demo import DEMO_DRAFTER, DEMO_NAME, DEMO_TARGET, cache_root

    demo_dir = cache_root() / f"{DEMO_NAME}-mlx"
    rows.append({"source": "demo", "name": DEMO_NAME, "target": DEMO_TARGET, "drafter": str(DEMO_DRAFTER),
                 "target_bytes": _local_size(str(demo_dir), cache) if demo_dir.exists() else None,
                 "drafter_bytes": _local_size(str(DEMO_DRAFTER), cache) if DEMO_DRAFTER.exists() else None})
    for pair in KNOWN_PAIRS:
        rows.append({"source": "registry", "name": pair.target, "target": pair.target, "drafter": pair.drafter,
                     "target_bytes": cache.get(pair.target), "drafter_bytes": cache.get(pair.drafter)})
    return rows
