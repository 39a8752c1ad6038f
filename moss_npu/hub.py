"""Model folders: a local path, or a Hugging Face hub id fetched with ``huggingface_hub``.

Hub downloads honour ``HF_ENDPOINT`` (mirrors such as hf-mirror.com, common on Ascend servers in China)
and ``HF_HUB_OFFLINE``; both are read by huggingface_hub itself. Nothing here runs at import time.
"""

from __future__ import annotations

import os
from pathlib import Path

from moss_npu.errors import CheckpointError

DEFAULT_MODEL = "OpenMOSS-Team/MOSS-TTS-Nano"
DEFAULT_CODEC = "OpenMOSS-Team/MOSS-Audio-Tokenizer-Nano"


def looks_like_hub_id(spec: str) -> bool:
    """Return whether ``spec`` reads as ``owner/name`` rather than a filesystem path."""
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not os.path.isabs(spec)


def resolve_model_dir(spec: str | os.PathLike, *, required: tuple[str, ...] = ("config.json",)) -> Path:
    """Return a local folder for ``spec`` holding the ``required`` files, downloading hub ids when allowed.

    Raises:
        CheckpointError: the folder is missing, lacks required files, or the hub id cannot be fetched.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists() or not looks_like_hub_id(text):
        if not path.is_dir():
            raise CheckpointError(f"model folder {text} does not exist; pass a folder holding {', '.join(required)} or a hub id such as {DEFAULT_MODEL}")
        _check_files(path, required)
        return path.resolve()
    return _download(text, required)


def _download(repo_id: str, required: tuple[str, ...]) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # an install without the hub client
        raise CheckpointError(f"{repo_id}: huggingface_hub is not installed; run pip install huggingface_hub") from exc
    try:
        folder = Path(snapshot_download(repo_id=repo_id))
    except Exception as exc:  # offline, unknown id, gated repo, network: all mean "not available here"
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        hint = (
            "HF_HUB_OFFLINE is set and the model is not in the local cache"
            if offline
            else f"download failed ({type(exc).__name__})"
        )
        raise CheckpointError(
            f"{repo_id}: {hint}; fetch it first with `huggingface-cli download {repo_id} --local-dir DIR` "
            f"(set HF_ENDPOINT for a mirror) and pass DIR"
        ) from exc
    _check_files(folder, required)
    return folder


def _check_files(folder: Path, required: tuple[str, ...]) -> None:
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise CheckpointError(f"model folder {folder} lacks {', '.join(missing)}; download the complete official folder")
