"""Stored voices: a recording's codes plus metadata, one safetensors file per voice under ``--voices-dir``.

The folder is the truth and servers may share it (docs/scaling.md#voices-shared-by-every-replica): each keeps
an index of its metadata, refreshed when the folder changes and on a miss; a voice file appears whole (temp file,
then rename) and a name is claimed by an exclusive create. Ids match a strict pattern before they touch a path.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moss_npu.serve.errors import ApiError, shown

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
    """The voices folder and this server's index of it (see the module docstring)."""

    CODES_CACHED = 256
    STALE_CLAIM_S = 30.0  # a name claim without its voice file, older than this, is left from a crash

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._index: dict[str, Voice] = {}
        self._seen_mtime: Optional[int] = None
        self._codes: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def _path(self, voice_id: str) -> Path:
        if not _ID.match(voice_id):
            raise ApiError(404, f"voice {shown(voice_id)} not found", param="voice", code="voice_not_found")
        return self.root / f"{voice_id}{_SUFFIX}"

    def _claim_path(self, name: str) -> Path:
        return self.root / f".name-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:32]}"

    @staticmethod
    def _read_meta(path: Path) -> Voice:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        return Voice(id=path.stem, name=meta["name"], transcript=meta.get("transcript") or None,
                     frames=int(meta["frames"]), duration_s=float(meta["duration_s"]),
                     created_at=int(meta["created_at"]))

    def _refresh(self, force: bool = False) -> None:
        """Bring the index in step with the folder: read the metadata of new files, drop removed ones."""
        try:
            mtime = os.stat(self.root).st_mtime_ns
        except OSError:
            mtime = None
        with self._lock:
            if not force and mtime is not None and mtime == self._seen_mtime:
                return
            ids = {p.stem for p in self.root.glob(f"voice_*{_SUFFIX}") if _ID.match(p.stem)}
            for gone in set(self._index) - ids:
                del self._index[gone]
                self._codes.pop(gone, None)
            for new in ids - set(self._index):
                try:
                    self._index[new] = self._read_meta(self.root / f"{new}{_SUFFIX}")
                except (OSError, KeyError, ValueError, SafetensorError):
                    continue  # damaged or half-written by a foreign tool: skipped, not fatal
            self._seen_mtime = mtime

    def list(self) -> list[Voice]:
        """Every readable voice, oldest first."""
        self._refresh()
        with self._lock:
            return sorted(self._index.values(), key=lambda v: (v.created_at, v.id))

    def _lookup(self, ref: str) -> Optional[Voice]:
        with self._lock:
            if ref in self._index:
                return self._index[ref]
            return next((v for v in self._index.values() if v.name == ref), None)

    def find(self, ref: str) -> tuple[Voice, torch.Tensor]:
        """Look a voice up by id or by name and return it with its codes (F, Q); 404 when there is none."""
        self._refresh()
        voice = self._lookup(ref)
        if voice is None:
            self._refresh(force=True)  # another server may have added it a moment ago
            voice = self._lookup(ref)
        if voice is None:
            raise ApiError(404, f"voice {shown(ref)} not found; list voices with GET /v1/audio/voices or upload one",
                           param="voice", code="voice_not_found")
        return voice, self._load_codes(voice)

    def _load_codes(self, voice: Voice) -> torch.Tensor:
        with self._lock:
            if voice.id in self._codes:
                self._codes.move_to_end(voice.id)
                return self._codes[voice.id]
        try:
            with safe_open(str(self._path(voice.id)), framework="pt") as fh:
                codes = fh.get_tensor("codes")
        except (OSError, SafetensorError):  # deleted through another server since the index was read
            self._refresh(force=True)
            raise ApiError(404, f"voice {voice.id!r} was deleted", param="voice", code="voice_not_found") from None
        with self._lock:
            self._codes[voice.id] = codes
            while len(self._codes) > self.CODES_CACHED:
                self._codes.popitem(last=False)
        return codes

    def add(self, name: str, codes: torch.Tensor, duration_s: float, transcript: Optional[str]) -> Voice:
        """Store codes (F, Q) under a new id, atomically; 409 when the name is taken (here or on a sharing server)."""
        name = check_name(name)
        self._refresh(force=True)
        if self._lookup(name) is not None:
            raise _name_taken(name)
        voice = Voice(id=f"voice_{uuid.uuid4().hex[:16]}", name=name, transcript=transcript or None,
                      frames=int(codes.shape[0]), duration_s=round(duration_s, 3), created_at=int(time.time()))
        meta = {k: "" if v is None else str(v) for k, v in asdict(voice).items() if k != "id"}  # safetensors: strings
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".voice-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({"codes": codes.to(torch.int64).contiguous()}, tmp, metadata=meta)
            os.chmod(tmp, 0o644)
            self._claim(name, voice.id)
            os.replace(tmp, self._path(voice.id))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        with self._lock:
            self._index[voice.id] = voice
        return voice

    def _claim(self, name: str, voice_id: str) -> None:
        """Create the name's claim file exclusively; 409 when a live voice holds it."""
        path = self._claim_path(name)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not self._stale_claim(path):
                    raise _name_taken(name) from None
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(voice_id)
            return
        raise _name_taken(name)

    def _stale_claim(self, path: Path) -> bool:
        """A claim whose voice file is missing and which is too old to be a write in progress."""
        try:
            holder = path.read_text().strip()
            age = time.time() - path.stat().st_mtime
        except OSError:
            return True
        return not (_ID.match(holder) and self._path(holder).is_file()) and age > self.STALE_CLAIM_S

    def delete(self, voice_id: str) -> Voice:
        """Remove a voice by id; 404 when there is none."""
        path = self._path(voice_id)
        try:
            voice = self._read_meta(path)
            path.unlink()
        except (FileNotFoundError, KeyError, ValueError, SafetensorError):
            raise ApiError(404, f"voice {shown(voice_id)} not found", param="voice_id", code="voice_not_found") from None
        claim = self._claim_path(voice.name)
        try:
            if claim.read_text().strip() == voice_id:
                claim.unlink()
        except OSError:
            pass  # a voice stored before claims existed, or a claim already gone
        with self._lock:
            self._index.pop(voice_id, None)
            self._codes.pop(voice_id, None)
        return voice


def _name_taken(name: str) -> ApiError:
    return ApiError(409, f"a voice named {name!r} exists; delete it first or choose another name", param="name",
                    code="voice_exists")
