"""Find model files: a local directory as is, otherwise a Hugging Face repo through huggingface_hub
(cached, with its progress bars). Failures say what to download or which local path to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class ModelNotFoundError(FileNotFoundError):
    pass


def looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


# What a server needs from a repo (not, say, the original PyTorch weights of a converted model).
TARGET_FILES = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
DRAFTER_FILES = ["*.json", "*.safetensors"]


def resolve(
    name: str, revision: Optional[str] = None, *, files: Optional[list[str]] = None, allow_download: bool = True
) -> Path:
    if name.startswith("demo:"):
        from .demo import DEMO_TARGET, demo_target_dir

        if name != DEMO_TARGET:
            raise ModelNotFoundError(f"{name}: unknown demo model (known: {DEMO_TARGET})")
        return demo_target_dir()
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
        return path
    if looks_like_local_path(name) or name.count("/") != 1:
        raise ModelNotFoundError(f"{name}: no such directory, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # Cached files first, so a model already on disk needs no network at all; an interrupted
        # download leaves a snapshot without its weights, which is finished below.
        cached = Path(snapshot_download(name, revision=revision, allow_patterns=files, local_files_only=True))
        if _complete(cached):
            return cached
        if not allow_download:
            raise ModelNotFoundError(f"{_not_cached(name, revision)} (the cached copy at {cached} lacks weights)")
    except LocalEntryNotFoundError:
        if not allow_download:
            raise ModelNotFoundError(_not_cached(name, revision)) from None
    try:
        # huggingface_hub draws its progress bars; files already cached are not fetched again.
        downloaded = Path(snapshot_download(name, revision=revision, allow_patterns=files))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise ModelNotFoundError(f"{_not_cached(name, revision)}\n  download failed: {type(e).__name__}: {e}") from e
    if not _complete(downloaded):  # offline mode hands back the partial snapshot as it is
        raise ModelNotFoundError(f"{_not_cached(name, revision)} (the cached copy at {downloaded} lacks weights)")
    return downloaded


def _complete(path: Path) -> bool:
    """config.json and the weights, every shard an index names included."""
    if not (path / "config.json").exists():
        return False
    index = path / "model.safetensors.index.json"
    if index.exists():
        import json

        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return bool(shards) and all((path / shard).exists() for shard in shards)
    return any(path.glob("*.safetensors"))


def _not_cached(name: str, revision: Optional[str]) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (
        f"{name}{'@' + revision if revision else ''} is not in the local Hugging Face cache. "
        f"Download it on a machine with network access (`hf download {name}{rev}`) "
        "or pass the path of a local model directory."
    )
