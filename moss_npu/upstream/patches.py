"""Device-neutral replacements for the CUDA-only spots of the official remote code, and their installer.

docs/upstream.md#cuda-only-spots lists the spots; ``patches/manifest.yaml`` names each target and its parameters.
``apply_patches`` checks every target's signature before replacing anything, and a mismatch raises naming the
upstream revision: a patch is never skipped. Methods are replaced on the loaded instances, never on the class.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

from moss_npu.device import Backend, attention_impl, chunk_batch_size
from moss_npu.errors import CheckpointError
from moss_npu.upstream.manifest import PatchEntry, PatchSet

_MARK = "__moss_npu_patch__"
# Device kinds the autocast guard must cover, added to as patches are installed; the host is always there.
_AUTOCAST_KINDS: set[str] = {kind for kind, kind_backend in Backend.builtin.items() if kind_backend.host}


def fallback_attention(device: torch.device) -> str:
    """Attention after the fp32 stability fallback, on any ``device`` (the official method's argument): the device
    layer's choice (sdpa)."""
    return attention_impl()


def voice_clone_chunk_batch_size(*, resolved_device: torch.device, chunk_count: int, max_memory_per_sample_gb: float) -> int:
    """Chunks generated at once: free memory from the device layer over the per-sample need (≥ 1)."""
    if chunk_count <= 1 or max_memory_per_sample_gb <= 0:
        return 1
    return chunk_batch_size(resolved_device, int(chunk_count), float(max_memory_per_sample_gb))


def load_reference(reference_audio_path: Any, target_sample_rate: int, target_channels: int) -> tuple[torch.Tensor, int]:
    """Reference audio as (C, S) float32 at ``target_sample_rate``, read through moss_npu.audio."""
    from moss_npu.audio import load_reference_audio

    wave = load_reference_audio(str(reference_audio_path), sample_rate=int(target_sample_rate), channels=int(target_channels))
    return wave, int(target_sample_rate)


def _audio_load(path: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
    """``torchaudio.load`` stand-in: (C, S) float32 tensor and the file's sample rate."""
    from moss_npu.audio import read_audio

    return read_audio(str(path))


def _audio_save(path: Any, src: torch.Tensor, sample_rate: int, *args: Any, **kwargs: Any) -> None:
    """``torchaudio.save`` stand-in: float32 WAV, written atomically, values kept as they are (no clipping)."""
    from moss_npu.output import write_wav

    write_wav(str(path), src.detach().to(device="cpu", dtype=torch.float32), int(sample_rate))


def audio_io_module() -> types.ModuleType:
    """Return the module that stands in for ``torchaudio`` in the official code (load/save only)."""
    module = types.ModuleType("torchaudio", "moss-npu stand-in: load/save through moss_npu.audio")
    module.load = _audio_load
    module.save = _audio_save
    setattr(module, _MARK, "audio_io")
    return module


def codec_autocast(codec: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """Return the codec's inference context: autocast to its ``compute_dtype`` on the device it lives on."""

    @contextlib.contextmanager
    def _codec_inference_autocast() -> Iterator[None]:
        compute_dtype = getattr(codec, "compute_dtype", None)
        if compute_dtype is None:
            yield
            return
        device = next(codec.parameters()).device
        with torch.autocast(device_type=device.type, dtype=compute_dtype):
            yield

    return _codec_inference_autocast


@contextlib.contextmanager
def disable_autocast() -> Iterator[None]:
    """Run the block in full precision: autocast off on the host and on every patched device kind."""
    with contextlib.ExitStack() as stack:
        for kind in sorted(_AUTOCAST_KINDS):
            try:
                guard = torch.autocast(device_type=kind, enabled=False)
            except RuntimeError:  # a kind this torch cannot autocast on has no autocast to turn off
                continue
            stack.enter_context(guard)
        yield


# Manifest ``replacement`` key -> how to build it. Method factories get (instance, device); config and
# runtime entries are carried out by folder.py and UpstreamTTS, and are listed so that every manifest
# entry has exactly one implementation.
METHOD_REPLACEMENTS: dict[str, Callable[[Any, torch.device], Callable]] = {
    "fallback_attention": lambda obj, device: fallback_attention,
    "chunk_batch_size": lambda obj, device: voice_clone_chunk_batch_size,
    "reference_audio": lambda obj, device: load_reference,
    "codec_autocast": lambda obj, device: codec_autocast(obj),
}
MODULE_REPLACEMENTS: dict[str, Callable[[], Any]] = {
    "audio_io": audio_io_module,
    "disable_autocast": lambda: disable_autocast,
}
CARRIED_ELSEWHERE = {"attention_setting": "folder.mirror_folder", "seed": "UpstreamTTS.infer", "empty_cache": "UpstreamTTS.close"}
REPLACEMENTS = set(METHOD_REPLACEMENTS) | set(MODULE_REPLACEMENTS) | set(CARRIED_ELSEWHERE)


def check_replacements(patches: PatchSet) -> None:
    """Raise CheckpointError unless manifest entries and implemented replacements match one to one."""
    named = {e.replacement for e in patches.entries}
    unknown = sorted(named - REPLACEMENTS)
    unused = sorted(REPLACEMENTS - named)
    if unknown or unused:
        raise CheckpointError(f"{patches.path}: replacements without code: {unknown or 'none'}; code without "
                              f"manifest entry: {unused or 'none'}; update moss_npu/upstream/patches.py together with "
                              "the manifest")


def apply_patches(objects: dict[str, Any], patches: PatchSet, *, device: torch.device) -> list[str]:
    """Install every method/function/module patch of the manifest on the loaded official ``objects`` (component
    name -> instance) running on ``device``; return the ids installed, in manifest order. CheckpointError when a
    component is missing, or a target is absent or has other parameters than the manifest records (the official
    code is not the revision the patch set was written for)."""
    check_replacements(patches)
    entries = [e for e in patches.entries if e.kind in ("method", "function", "module_attr")]
    # Check everything first, so that a mismatch leaves nothing half-patched.
    resolved = [(entry, _check(entry, objects, patches)) for entry in entries]
    _AUTOCAST_KINDS.add(device.type)
    for entry, (obj, module) in resolved:
        name = entry.target.rsplit(".", 1)[-1]
        if entry.kind == "method":
            replacement = METHOD_REPLACEMENTS[entry.replacement](obj, device)
            obj.__dict__[name] = replacement  # instance attribute: shadows the class method for this object only
        elif getattr(getattr(module, name), _MARK, None) != entry.replacement:
            replacement = MODULE_REPLACEMENTS[entry.replacement]()
            if callable(replacement) and not isinstance(replacement, types.ModuleType):
                setattr(replacement, _MARK, entry.replacement)
            setattr(module, name, replacement)
    return [entry.id for entry in entries]


def _check(entry: PatchEntry, objects: dict[str, Any], patches: PatchSet) -> tuple[Any, types.ModuleType]:
    """Return (instance, module) for an entry after checking that its target matches the manifest."""
    where = entry.where(patches.repo_of(entry))
    if entry.component not in objects:
        raise CheckpointError(f"patch {entry.id}: no loaded {entry.component} object to patch ({where})")
    obj = objects[entry.component]
    module = sys.modules.get(type(obj).__module__)
    module_name = getattr(module, "__name__", type(obj).__module__)
    if module is None or module_name.rsplit(".", 1)[-1] != entry.module:
        raise CheckpointError(f"patch {entry.id}: the loaded {entry.component} class comes from module {module_name}, "
                              f"not {entry.module} ({where}); load the official code of that revision")
    if entry.kind == "module_attr":
        if not hasattr(module, entry.target):
            raise _mismatch(entry, where, f"module {entry.module} has no name {entry.target}")
        for user in entry.used_by:
            if _lookup(module, user) is None:
                raise _mismatch(entry, where, f"{user} not found")
        return obj, module
    target = _lookup(module, entry.target)
    if target is None:
        raise _mismatch(entry, where, "not found")
    owner = _lookup(module, entry.target.split(".", 1)[0]) if entry.kind == "method" else None
    if owner is not None and not isinstance(obj, owner):
        raise _mismatch(entry, where, f"the loaded {entry.component} object is a {type(obj).__name__}")
    found = _params(target)
    if found != entry.params:
        raise _mismatch(entry, where, f"parameters are ({', '.join(found or ())}), expected ({', '.join(entry.params or ())})")
    return obj, module


def _lookup(module: types.ModuleType, dotted: str) -> Optional[Any]:
    value: Any = module
    for part in dotted.split("."):
        value = inspect.getattr_static(value, part, None)
        if value is None:
            return None
    return value


def _params(target: Any) -> Optional[tuple[str, ...]]:
    """Parameter names of a function, method, staticmethod or classmethod found with getattr_static."""
    func = target.__func__ if isinstance(target, (staticmethod, classmethod)) else target
    try:
        names = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if isinstance(target, classmethod) else names


def _mismatch(entry: PatchEntry, where: str, what: str) -> CheckpointError:
    return CheckpointError(f"official code does not match patch {entry.id}: {entry.target}: {what}; the patch set was "
                           f"written against {where} — use the official code of that revision or update "
                           "patches/manifest.yaml")
