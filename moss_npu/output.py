"""Audio files out through soundfile: the format follows the extension (``FORMATS``), only regular files are
written, and atomically.

``.wav`` is float32 by default (unclipped, like the official ``torchaudio.save``); integer and lossy formats clip
to [-1, 1]. A folder, device file, FIFO or socket is refused; a symlink is written through (its target replaced,
as a shell redirect would). Audio goes to a hidden temp file beside the target, renamed over it only when
complete; an error or interruption removes it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from moss_npu.errors import InputError, OutputError

if TYPE_CHECKING:
    import numpy as np
    import torch

PathLike = Union[str, Path]
# numpy, soundfile and torch are imported on use, so the CLIs that import this module start (and answer
# Ctrl-C with one line) before any heavy library loads.

# extension -> (libsndfile format, subtype, sample rates it allows (None: any))
FORMATS: dict[str, tuple[str, str, Optional[tuple[int, ...]]]] = {
    ".wav": ("WAV", "FLOAT", None),
    ".flac": ("FLAC", "PCM_24", None),
    ".ogg": ("OGG", "VORBIS", None),
    ".opus": ("OGG", "OPUS", (8000, 12000, 16000, 24000, 48000)),
    ".mp3": ("MP3", "MPEG_LAYER_III", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
}
WAV_SUBTYPES = ("FLOAT", "PCM_16", "PCM_24", "PCM_32")
_FILE_MODE = 0o644  # mkstemp creates 0600; a written audio file is an ordinary, readable file
_LOW_SPACE_BYTES = 1 << 20
_MAX_NAME_BYTES = 255 - 16  # the temp file beside it adds a dot, 8 random characters and ".tmp"


@dataclass(frozen=True)
class AudioTarget:
    """Where and how to write: the path named by the user, the file actually replaced, format and subtype."""

    path: Path
    real_path: Path
    format: str
    subtype: str
    rates: Optional[tuple[int, ...]] = None

    @property
    def clips(self) -> bool:
        """Whether samples are clipped to [-1, 1] (every subtype but float)."""
        return self.subtype not in ("FLOAT", "DOUBLE")

    def check_rate(self, sample_rate: int) -> None:
        """Refuse a sample rate the format cannot store (e.g. Opus at 44.1 kHz)."""
        if self.rates is not None and int(sample_rate) not in self.rates:
            raise InputError(f"--output {self.path}: {self.format}/{self.subtype} cannot store {sample_rate} Hz "
                             "audio; write .wav or .flac instead")


def audio_target(path: PathLike, wav_subtype: Optional[str] = None, *, flag: str = "--output") -> AudioTarget:
    """Check ``path`` before any model loads and return how it will be written (InputError: an unknown extension,
    one this libsndfile cannot write, ``wav_subtype`` on a non-WAV file, or not a writable regular file)."""
    path = Path(path)
    real = writable_file(path, flag)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError(f"{flag} {path}: unknown audio extension {suffix or '(none)'!s}; use one of "
                         f"{', '.join(FORMATS)}")
    fmt, subtype, rates = FORMATS[suffix]
    if wav_subtype is not None:
        if suffix != ".wav":
            raise InputError(f"--wav-subtype {wav_subtype}: only applies to .wav output, not {suffix}; drop it")
        if wav_subtype not in WAV_SUBTYPES:
            raise InputError(f"--wav-subtype {wav_subtype}: use one of {', '.join(WAV_SUBTYPES)}")
        subtype = wav_subtype
    import soundfile

    if subtype not in soundfile.available_subtypes(fmt):
        raise InputError(f"{flag} {path}: libsndfile {soundfile.__libsndfile_version__} cannot write {suffix}; "
                         "run `pip install -U 'soundfile>=0.12.1'` (libsndfile >= 1.1) or write .wav")
    return AudioTarget(path, real, fmt, subtype, rates)


def writable_file(path: PathLike, flag: str = "--output") -> Path:
    """Return the regular file that writing ``path`` will replace (symlinks resolved); InputError for a folder,
    device, FIFO or socket, a symlink loop, a missing or read-only folder, or a read-only file."""
    path = Path(path)
    if len(path.name.encode()) > _MAX_NAME_BYTES:
        raise InputError(f"{flag} {path.name[:40]}…: file name too long ({len(path.name.encode())} bytes, at most "
                         f"{_MAX_NAME_BYTES}); choose a shorter name")
    real = Path(os.path.realpath(path))
    if real.is_symlink():  # realpath leaves a link it cannot resolve: a loop
        raise InputError(f"{flag} {path}: is a symlink loop; remove the link or choose another path")
    shown = f"{path}" if real == path.absolute() else f"{path} (-> {real})"
    if real.exists():
        mode = real.stat().st_mode
        if stat.S_ISDIR(mode):
            raise InputError(f"{flag} {shown}: is a folder; give a file name such as {path / 'out.wav'}")
        if not stat.S_ISREG(mode):
            kind = ("a device file" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise InputError(f"{flag} {shown}: is {kind}; only regular files are written, give a file name")
        if not os.access(real, os.W_OK):
            raise InputError(f"{flag} {shown}: the file is read-only; choose another path")
    folder = real.parent
    if not folder.is_dir():
        raise InputError(f"{flag} {shown}: folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {shown}: folder {folder} is not writable; choose a writable path")
    _probe(folder, shown, flag)
    return real


def refuse_own_inputs(real: Path, shown: PathLike, inputs: dict[str, Optional[str]], flag: str = "--output") -> None:
    """Refuse writing ``real`` (a resolved ``writable_file``) when it is one of the run's ``inputs`` (each input
    flag, ``--text-file``, to its value; None or ``-``: not a file)."""
    for input_flag, value in inputs.items():
        if value and value != "-" and os.path.realpath(value) == str(real):
            raise InputError(f"{flag} {shown}: is the {input_flag} file; choose another path")


def _probe(folder: Path, shown: str, flag: str) -> None:
    """Create and remove a temp file in ``folder``: what permissions alone cannot tell (read-only mounts,
    /proc, a full disk) shows up now, before any model loads."""
    try:
        fd, tmp = tempfile.mkstemp(dir=str(folder), prefix=".moss-npu-probe.", suffix=".tmp")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"no space left writing {shown}; free some space or choose another {flag} folder") from None
        raise InputError(f"{flag} {shown}: cannot create files in {folder} ({exc.strerror}); choose another "
                         "path") from None
    os.close(fd)
    os.unlink(tmp)


class AtomicAudioWriter:
    """Write audio chunk by chunk to a temp file that replaces the target only on ``close()``; as a context
    manager, leaving the block normally finalizes and an exception (a signal's KeyboardInterrupt too) deletes it."""

    def __init__(self, target: AudioTarget, sample_rate: int, channels: int) -> None:
        import soundfile

        target.check_rate(sample_rate)
        self.target, self.channels = target, int(channels)
        self.samples_written = 0
        folder = target.real_path.parent
        self._tmp: Optional[Path] = None
        try:
            fd, tmp = tempfile.mkstemp(dir=str(folder), prefix=f".{target.real_path.name}.", suffix=".tmp")
            os.close(fd)
            self._tmp = Path(tmp)
            self._file: "Optional[soundfile.SoundFile]" = soundfile.SoundFile(
                tmp, mode="w", samplerate=int(sample_rate), channels=self.channels, format=target.format,
                subtype=target.subtype)
        except BaseException as exc:
            self._remove_tmp()
            raise self._failure(exc) if isinstance(exc, (OSError, RuntimeError)) else exc

    def write(self, chunk: "torch.Tensor") -> None:
        """Append ``(C, n)`` samples (float formats store them as they are; others clip to [-1, 1])."""
        if self._file is None:
            raise OutputError(f"output {self.target.path}: writer already closed")
        frames = as_frames(chunk)
        if frames.shape[1] != self.channels:
            raise InputError(f"output {self.target.path}: chunk has {frames.shape[1]} channels, writer has "
                             f"{self.channels}")
        if self.target.clips:
            frames = frames.clip(-1.0, 1.0)
        try:
            self._file.write(frames)
        except (OSError, RuntimeError) as exc:
            raise self._failure(exc) from exc
        self.samples_written += frames.shape[0]

    def close(self) -> Path:
        """Finish the file and move it into place atomically; return the path named by the user."""
        if self._file is None:
            return self.target.path
        try:
            self._file.close()
            self._file = None
            os.chmod(self._tmp, _FILE_MODE)
            os.replace(self._tmp, self.target.real_path)
        except (OSError, RuntimeError) as exc:
            self.abort()
            raise self._failure(exc) from exc
        self._tmp = None
        return self.target.path

    def abort(self) -> None:
        """Drop everything written; no file is left behind."""
        if self._file is not None:
            try:
                self._file.close()
            except (OSError, RuntimeError):
                pass  # a full disk can fail the final header write too; the file goes anyway
            self._file = None
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def _failure(self, exc: BaseException) -> OutputError:
        """Name the cause of a failed write: libsndfile reports a full disk only as a "System error"."""
        where = self.target.path
        full = getattr(exc, "errno", None) == errno.ENOSPC
        try:
            vfs = os.statvfs(self.target.real_path.parent)
            full = full or vfs.f_bavail * vfs.f_frsize < _LOW_SPACE_BYTES
        except OSError:
            pass
        if full:
            return OutputError(f"no space left writing {where}; free some space or choose another --output folder")
        return OutputError(f"cannot write {where}: {type(exc).__name__} {str(exc).strip() or 'I/O error'}; "
                           "check the disk and the folder")

    def __enter__(self) -> "AtomicAudioWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def as_frames(wave: "torch.Tensor | np.ndarray") -> np.ndarray:
    """Return ``(C, S)`` (or ``(S,)``) audio as a contiguous float32 ``(S, C)`` array for soundfile."""
    import numpy as np

    if hasattr(wave, "detach"):  # a torch tensor, on any device
        wave = wave.detach().cpu().float().numpy()
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 1:
        wave = wave[None]
    if wave.ndim != 2:
        raise InputError(f"audio output: expected a (channels, samples) waveform, got shape {tuple(wave.shape)}")
    return np.ascontiguousarray(wave.T)


def save_audio(path: PathLike, wave: "torch.Tensor", sample_rate: int, *, wav_subtype: Optional[str] = None,
               target: Optional[AudioTarget] = None) -> Path:
    """Write ``(C, S)`` float audio to ``path`` in the format its extension names, atomically; ``target`` (from
    ``audio_target``, checked earlier) skips repeating the path checks."""
    target = target or audio_target(path, wav_subtype)
    channels = 1 if len(wave.shape) == 1 else wave.shape[0]
    with AtomicAudioWriter(target, sample_rate, channels) as writer:
        writer.write(wave)
    return target.path


def write_wav(path: PathLike, wave: "torch.Tensor", sample_rate: int) -> Path:
    """Write float32 WAV at ``path`` whatever its name (the official ``torchaudio.save`` stand-in), atomically."""
    target = AudioTarget(Path(path), writable_file(path, "audio file"), "WAV", "FLOAT")
    return save_audio(path, wave, sample_rate, target=target)


def write_json(path: PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON (UTF-8, one final newline) to ``path`` atomically: a temp file in the same
    folder, then a rename, so a failure never leaves a partial file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600; this is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
