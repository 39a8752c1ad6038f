"""Model folders: a local path, or a Hugging Face hub id fetched with ``huggingface_hub``, which itself honours
``HF_ENDPOINT`` (mirrors such as hf-mirror.com) and ``HF_HUB_OFFLINE``. Download hints name this module's own
command, which exists whatever huggingface_hub ships:

    python -m moss_npu.hub download OpenMOSS-Team/MOSS-TTS-Nano models/MOSS-TTS-Nano
    python -m moss_npu.hub download OpenMOSS-Team/MOSS-TTS weights/MOSS-TTS-GGUF --include config.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from moss_npu.errors import CheckpointError, DownloadError

DEFAULT_MODEL = "OpenMOSS-Team/MOSS-TTS-Nano"
DEFAULT_CODEC = "OpenMOSS-Team/MOSS-Audio-Tokenizer-Nano"


def looks_like_hub_id(spec: str) -> bool:
    """Return whether ``spec`` reads as ``owner/name`` rather than a filesystem path."""
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not os.path.isabs(spec)


def download_command(repo_id: str, folder: str = "DIR", include: Sequence[str] = ()) -> str:
    """Return the shell command that downloads ``repo_id`` (only the ``include`` files if given) into ``folder``."""
    extra = "".join(f" --include {pattern}" for pattern in include)
    return f"python -m moss_npu.hub download {repo_id} {folder}{extra}"


def resolve_model_dir(spec: str | os.PathLike, *, required: tuple[str, ...] = ("config.json",),
                      role: str = "model", example: str = DEFAULT_MODEL) -> Path:
    """Return a local folder for ``spec`` holding the ``required`` files, downloading hub ids when allowed;
    CheckpointError names it by ``role`` and ``example`` (``codec``, ``DEFAULT_CODEC``) when it cannot."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists() or not looks_like_hub_id(text):
        if not path.is_dir():
            raise CheckpointError(f"{role} folder {text} does not exist; pass a folder holding "
                                  f"{', '.join(required)} or a hub id such as {example}")
        _check_files(path, required)
        return path.resolve()
    folder = snapshot(text)
    _check_files(folder, required)
    return folder


def snapshot(repo_id: str, local_dir: Optional[Path] = None, include: Optional[Sequence[str]] = None,
             revision: Optional[str] = None) -> Path:
    """Fetch ``repo_id`` (into the hub cache, or ``local_dir``) and return its folder.

    Raises:
        CheckpointError: huggingface_hub is missing, the id is unknown or gated, or offline and not cached.
        DownloadError: the network or mirror failed on the way (a runtime failure).
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # an install without the hub client
        raise CheckpointError(f"{repo_id}: huggingface_hub is not installed; run pip install huggingface_hub") from exc
    try:
        return Path(snapshot_download(repo_id=repo_id, local_dir=local_dir, allow_patterns=include or None,
                                      revision=revision))
    except Exception as exc:  # offline, unknown id, gated repo, network: all mean "not available here"
        reason, transient = _failure_reason(exc)
        error = DownloadError if transient else CheckpointError
        raise error(f"{repo_id}: {reason}; {_fix(repo_id, local_dir)}") from exc


def _failure_reason(exc: Exception) -> tuple[str, bool]:
    """Say why a download failed, and whether the cause is on the way (network) rather than in the request."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False"):
        return "HF_HUB_OFFLINE is set and the files are not in the local cache", False
    name = type(exc).__name__
    if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return f"not found or not accessible on {os.environ.get('HF_ENDPOINT', 'huggingface.co')} ({name})", False
    return f"download failed ({name})", True


def _fix(repo_id: str, local_dir: Optional[Path]) -> str:
    if local_dir is None:
        return (f"fetch it first with `{download_command(repo_id)}` (set HF_ENDPOINT for a mirror) and pass DIR")
    return "check the id, the network, or set HF_ENDPOINT to a reachable mirror"


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m moss_npu.hub download ID DIR [--include PATTERN]...``: fetch a hub repository into DIR."""
    from moss_npu.cli import ArgumentParser, run_cli

    def body() -> int:
        p = ArgumentParser(prog="python -m moss_npu.hub", description="Download a model folder from the Hugging "
                           "Face hub (honours HF_ENDPOINT and HF_HUB_OFFLINE).")
        sub = p.add_subparsers(dest="command", required=True)
        down = sub.add_parser("download", help="fetch a repository into a folder")
        down.add_argument("repo_id", help="hub id such as " + DEFAULT_MODEL)
        down.add_argument("folder", help="local folder to fill (created if missing)")
        down.add_argument("--include", action="append", help="only files matching this glob (repeatable)")
        down.add_argument("--revision", help="branch, tag or commit (default main)")
        args = p.parse_args(argv)
        if not looks_like_hub_id(args.repo_id):
            raise CheckpointError(f"{args.repo_id}: not a hub id; use OWNER/NAME such as {DEFAULT_MODEL}")
        folder = Path(args.folder).expanduser()
        if folder.exists() and not folder.is_dir():
            raise CheckpointError(f"{folder}: exists and is not a folder; choose another DIR")
        path = snapshot(args.repo_id, folder, args.include, args.revision)
        print(f"downloaded {args.repo_id} to {path}")
        return 0

    return run_cli(body)


def _check_files(folder: Path, required: tuple[str, ...]) -> None:
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise CheckpointError(f"model folder {folder} lacks {', '.join(missing)}; download the complete official folder")


if __name__ == "__main__":
    sys.exit(main())
