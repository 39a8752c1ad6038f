"""Stored voices: a recording's codes plus metadata, one safetensors file per voice under ``--voices-dir``.

A voice is encoded once when it is uploaded; requests then reuse its codes. Files appear whole (temp file in
the same folder, then rename), and the folder is read on every lookup, so several servers can share it (a
network file system behind a load balancer). Ids are generated here and checked against a strict pattern
before they touch a path, so no request can reach outside the folder.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moss_npu.serve.errors import ApiError

_ID = re.compile(r"^voice_[0-9a-f]{16}$")
_SUFFIX = ".safetensors"
MAX_NAME = 64


@dataclass(frozen=True)
class Voice:
    """A stored voice's metadata (its codes live in the same file)."""

    id: str
    name: str
    transcript: Optional[str]
    frames: int
    duration_s: float
    created_at: int

    def public(self) -> dict:
        """The JSON the API answers with."""
        return {"object": "voice", **asdict(self)}


def check_name(name: str) -> str:
    """Return a usable voice name (trimmed), or raise 400."""
    name = name.strip()
    if not name or len(name) > MAX_NAME or any(not c.isprintable() for c in name):
        raise ApiError(400, f"voice name must be 1..{MAX_NAME} printable characters", param="name",
                       code="invalid_value")
    if name == "default" or _ID.match(name):
        raise ApiError(400, f"voice name {name!r} is reserved; choose another", param="name", code="invalid_value")
    return name


class VoiceStore:
    """The voices folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, voice_id: str) -> Path:
        if not _ID.match(voice_id):
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice", code="voice_not_found")
        return self.root / f"{voice_id}{_SUFFIX}"

    def _read(self, path: Path) -> tuple[Voice, torch.Tensor]:
        with safe_open(str(path), framework="pt") as fh:
            meta, codes = fh.metadata() or {}, fh.get_tensor("codes")
        voice = Voice(id=path.name[: -len(_SUFFIX)], name=meta["name"], transcript=meta.get("transcript") or None,
                      frames=int(meta["frames"]), duration_s=float(meta["duration_s"]),
                      created_at=int(meta["created_at"]))
        return voice, codes

    def list(self) -> list[Voice]:
        """Every readable voice, oldest first (a damaged file is skipped, not fatal)."""
        voices = []
        for path in self.root.glob(f"voice_*{_SUFFIX}"):
            try:
                voices.append(self._read(path)[0])
            except (OSError, KeyError, ValueError, SafetensorError):
                continue
        return sorted(voices, key=lambda v: (v.created_at, v.id))

    def find(self, ref: str) -> tuple[Voice, torch.Tensor]:
        """Look a voice up by id or by name; 404 when there is none."""
        if _ID.match(ref) and self._path(ref).is_file():
            return self._read(self._path(ref))
        for voice in self.list():
            if voice.name == ref:
                return self._read(self._path(voice.id))
        raise ApiError(404, f"voice {ref!r} not found; list voices with GET /v1/audio/voices or upload one",
                       param="voice", code="voice_not_found")

    def add(self, name: str, codes: torch.Tensor, duration_s: float, transcript: Optional[str]) -> Voice:
        """Store codes (F, Q) under a new id, atomically; 409 when the name is taken."""
        name = check_name(name)
        if any(v.name == name for v in self.list()):
            raise ApiError(409, f"a voice named {name!r} exists; delete it first or choose another name",
                           param="name", code="voice_exists")
        voice = Voice(id=f"voice_{uuid.uuid4().hex[:16]}", name=name, transcript=transcript or None,
                      frames=int(codes.shape[0]), duration_s=round(duration_s, 3), created_at=int(time.time()))
        meta = {"name": voice.name, "transcript": voice.transcript or "", "frames": str(voice.frames),
                "duration_s": str(voice.duration_s), "created_at": str(voice.created_at)}
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".voice-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({"codes": codes.to(torch.int64).contiguous()}, tmp, metadata=meta)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self._path(voice.id))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return voice

    def delete(self, voice_id: str) -> Voice:
        """Remove a voice by id; 404 when there is none."""
        path = self._path(voice_id)
        try:
            voice = self._read(path)[0]
            path.unlink()
        except FileNotFoundError:
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice_id", code="voice_not_found") from None
        return voice
