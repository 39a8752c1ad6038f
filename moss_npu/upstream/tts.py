"""The official MOSS-TTS-Nano remote code, loaded with the patch set, behind one small class (``--impl upstream``).

``load_upstream`` mirrors the official folders with patched configs (folder.py), loads them with
``trust_remote_code=True`` (transformers imported only here) and installs the patches (patches.py). ``infer`` and
``stream`` wrap the official ``inference`` and ``inference_stream``; the lower-level methods give eval_accuracy.py
the official hidden states, logits and codes. Shapes: L prompt rows, F frames, Q = 16 codebooks, S samples.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from moss_npu.device import attention_impl, backend, seed_everything, warn_if_bf16_is_emulated
from moss_npu.errors import CheckpointError, ConfigError, DeviceError, InputError
from moss_npu.hub import DEFAULT_CODEC, resolve_model_dir
from moss_npu.upstream.folder import mirror_folder
from moss_npu.upstream.manifest import PatchSet, load_manifest
from moss_npu.upstream.patches import apply_patches, audio_io_module

# Arguments of the official inference()/inference_stream() that UpstreamTTS itself supplies.
_OWNED_ARGS = {
    "self", "text", "output_audio_path", "mode", "prompt_text", "prompt_audio_path", "reference_audio_path",
    "text_tokenizer", "text_tokenizer_path", "audio_tokenizer", "audio_tokenizer_type",
    "audio_tokenizer_pretrained_name_or_path", "device",
}
_INSTALL_HINT = 'pip install -e ".[upstream]"'
_MIN_TRANSFORMERS = (4, 57)


@dataclass(frozen=True)
class UpstreamResult:
    """What the official ``inference`` returned: waveform (2, S) float32 on the host, codes (F, Q) int64."""

    waveform: torch.Tensor
    sample_rate: int
    codes: torch.Tensor
    text_chunks: tuple[str, ...]
    chunk_batch_size: int


@dataclass(frozen=True)
class UpstreamGeneration:
    """Codes (F, Q) int64 from the official ``generate``; with ``record_logits`` also every logits row the
    sampler saw: ``text_logits`` (steps, 2) over [audio_assistant_slot, audio_end], ``audio_logits``
    (F·nq, V) in generation order (both float32 on the host)."""

    codes: torch.Tensor
    text_logits: Optional[torch.Tensor] = None
    audio_logits: Optional[torch.Tensor] = None


class UpstreamTTS:
    """The patched official model, codec and tokenizer on one device. Use ``load_upstream`` to build one."""

    def __init__(self, model: Any, codec: Any, tokenizer: Any, *, device: torch.device, dtype: torch.dtype,
                 patches: Optional[PatchSet] = None) -> None:
        """Wrap already-loaded official objects and install the patch set on them (see ``apply_patches``)."""
        self.model, self.codec, self.tokenizer = model, codec, tokenizer
        self.device, self.dtype = device, dtype
        self.patches = load_manifest() if patches is None else patches
        compute_dtype = getattr(codec, "compute_dtype", None)
        if compute_dtype is not None and not backend(device).supports_dtype(compute_dtype):
            raise DeviceError(f"codec compute_dtype {compute_dtype} is not supported on {device}; set compute_dtype to "
                              "fp32 in the codec config.json")
        self.applied = tuple(apply_patches({"tts": model, "codec": codec}, self.patches, device=device))

    @property
    def sample_rate(self) -> int:
        """Output sample rate of the codec in Hz (48000 for the official codec)."""
        return int(self.codec.sampling_rate)

    def __enter__(self) -> "UpstreamTTS":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model and codec and give their cached device memory back (backend(device).empty_cache)."""
        self.model = self.codec = self.tokenizer = None
        gc.collect()
        backend(self.device).empty_cache()

    def _inference_kwargs(self, method: str, params: dict[str, Any], seed: Optional[int]) -> dict[str, Any]:
        """Check ``params`` against the official ``method``'s arguments, seed like the official runtime, and return
        the arguments of the call."""
        allowed = [p for p in inspect.signature(getattr(self.model, method)).parameters if p not in _OWNED_ARGS]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise InputError(f"unknown generation parameters {', '.join(unknown)}; the official {method} takes {', '.join(allowed)}")
        if seed is not None:
            seed_everything(int(seed), self.device)
        return dict(params, text_tokenizer=self.tokenizer, audio_tokenizer=self.codec, device=self.device)

    def infer(self, text: str, *, mode: str = "continuation", prompt_audio_path: Optional[str] = None,
              prompt_text: Optional[str] = None, output_path: Optional[str] = None, seed: Optional[int] = None,
              **params: Any) -> UpstreamResult:
        """Run the official ``inference`` and return what it reports. ``params`` are its generation arguments by
        their official names (``max_new_frames``, ``audio_top_k``, ...; InputError for an unknown one), omitted
        ones keep its defaults; ``output_path`` gets its WAV (None: a discarded temp file); ``seed`` seeds the host
        and the device first, as the official runtime does."""
        kwargs = self._inference_kwargs("inference", params, seed)
        with _output_path(output_path) as path, torch.no_grad():
            out = self.model.inference(text=text, output_audio_path=path, mode=mode, prompt_text=prompt_text,
                                       prompt_audio_path=prompt_audio_path, **kwargs)
        return UpstreamResult(
            waveform=out["waveform"].detach().to("cpu", torch.float32),
            sample_rate=int(out["sample_rate"]),
            codes=out["audio_token_ids"].detach().cpu(),
            text_chunks=tuple(out.get("voice_clone_text_chunks") or ()),
            chunk_batch_size=int(out.get("voice_clone_chunk_batch_size", 1)),
        )

    def stream(self, text: str, mode: str = "continuation", prompt_audio_path: Optional[str] = None,
               prompt_text: Optional[str] = None, *, output_path: Optional[str] = None, seed: Optional[int] = None,
               **params: Any) -> Iterator[torch.Tensor]:
        """Yield the official ``inference_stream`` audio chunks, each (2, n) float32 on the host, pauses included."""
        kwargs = self._inference_kwargs("inference_stream", params, seed)
        with _output_path(output_path) as path, torch.no_grad():
            for event in self.model.inference_stream(text=text, output_audio_path=path, mode=mode,
                                                     prompt_text=prompt_text, prompt_audio_path=prompt_audio_path,
                                                     **kwargs):
                if event.get("type") == "audio":
                    yield event["waveform"].detach().to("cpu", torch.float32)

    # Lower-level access for eval_accuracy.py --against upstream and the golden checks.

    def load_reference(self, path: str) -> torch.Tensor:
        """Reference audio as the official code prepares it: (C, S) float32 at the codec rate and channels."""
        wave, _ = self.model._load_reference_audio(path, self.sample_rate, int(self.codec.number_channels))
        return wave

    def prompt_rows(self, text: str, mode: str = "continuation", prompt_text: Optional[str] = None,
                    prompt_audio_codes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Official prompt rows (L, 17) int64 on the host; ``prompt_audio_codes`` is (F, Q)."""
        codes = None if prompt_audio_codes is None else torch.as_tensor(prompt_audio_codes, dtype=torch.long)
        with torch.no_grad():
            rows, _ = self.model.build_inference_input_ids(text, self.tokenizer, mode=mode, prompt_text=prompt_text,
                                                           prompt_audio_codes=codes, device=self.device)
        return rows[0].cpu()

    def hidden_states(self, rows: torch.Tensor) -> torch.Tensor:
        """Global transformer output after ``ln_f`` for prompt rows (L, 17): (L, hidden) float32 on the host."""
        with torch.no_grad():
            out = self.model(input_ids=torch.as_tensor(rows, dtype=torch.long)[None].to(self.device))
        return out.global_hidden_states[0].float().cpu()

    def teacher_forced(self, rows: torch.Tensor, frame_row: torch.Tensor) -> dict[str, torch.Tensor]:
        """One frame under teacher forcing of prompt ``rows`` (L, 17) and ``frame_row`` (17,) [text id, the frame's
        Q audio ids], computed by the official modules as its generation loop does. Float32 on the host:
        ``global_hidden`` (L, E); ``local_hidden`` (Q + 1, E), the local transformer over [last global hidden,
        wte(text id), audio embeddings of channels 0..Q-2]; ``text_logits`` (V_text,) from its first position;
        ``audio_logits`` (Q, V) channel c from position c + 1; ``decode_step_hidden`` (E,), ``frame_row`` appended
        through the official KV cache."""
        model = self.model
        x = torch.as_tensor(rows, dtype=torch.long)[None].to(self.device)
        frame = torch.as_tensor(frame_row, dtype=torch.long).to(self.device)
        length, q = x.shape[1], int(model.config.n_vq)
        with torch.no_grad():
            prompt = model(input_ids=x, attention_mask=torch.ones(1, length, dtype=torch.bool, device=self.device),
                           use_cache=True)
            hidden = prompt.global_hidden_states  # (1, L, E)
            local_dtype = model.local_transformer.ln_f.weight.dtype
            pieces = [hidden[:, -1], model.transformer.wte(frame[None, 0])]
            pieces += [model.audio_embeddings[c](frame[None, c + 1]) for c in range(q - 1)]
            seq = torch.stack([p.to(local_dtype) for p in pieces], dim=1)  # (1, Q + 1, E)
            # The official loop re-runs the local transformer on each growing prefix and keeps the last row.
            local = torch.stack([model._decode_local_last_hidden_state(seq[:, : k + 1])[0] for k in range(q + 1)])
            audio_logits = torch.stack([model.audio_lm_heads[c](local[c + 1]) for c in range(q)])
            text_logits = model.text_lm_head(local[0])
            step = model(input_ids=frame[None, None], past_key_values=prompt.past_key_values, use_cache=True,
                         attention_mask=torch.ones(1, length + 1, dtype=torch.bool, device=self.device))
        return {"global_hidden": _host(hidden[0]), "local_hidden": _host(local),
                "text_logits": _host(text_logits), "audio_logits": _host(audio_logits),
                "decode_step_hidden": _host(step.global_hidden_states[0, -1])}

    def generate_codes(self, rows: torch.Tensor, *, max_new_frames: int, nq: Optional[int] = None,
                       do_sample: bool = False, seed: Optional[int] = None, record_logits: bool = False,
                       **sampling: Any) -> UpstreamGeneration:
        """Official ``generate`` on one prompt (L, 17); greedy unless ``do_sample``.

        ``sampling`` takes the official names (``text_temperature``, ``audio_top_p``, ...). Logits are
        recorded by observing the official finite-logits check, which sees every row the sampler gets.
        """
        text_rows: list[torch.Tensor] = []
        audio_rows: list[torch.Tensor] = []
        if record_logits:
            check = self.model._ensure_finite_generation_logits
            slot, end = int(self.model.config.audio_assistant_slot_token_id), int(self.model.config.audio_end_token_id)

            def observe(logits: torch.Tensor, name: str) -> None:
                rows_seen = logits.detach().float().cpu()
                if name.startswith("text"):
                    text_rows.append(rows_seen[..., [slot, end]])
                else:
                    audio_rows.append(rows_seen)
                check(logits, name)

            self.model.__dict__["_ensure_finite_generation_logits"] = observe
        if seed is not None:
            seed_everything(int(seed), self.device)
        try:
            with torch.no_grad():
                out = self.model.generate(input_ids=torch.as_tensor(rows, dtype=torch.long)[None].to(self.device),
                                          nq=nq, max_new_frames=int(max_new_frames), do_sample=bool(do_sample), **sampling)
        finally:
            if record_logits:
                del self.model.__dict__["_ensure_finite_generation_logits"]
        codes = out.audio_token_ids[0].cpu()  # channels >= nq already hold the audio pad id
        if not record_logits:
            return UpstreamGeneration(codes)
        return UpstreamGeneration(codes, torch.cat(text_rows, 0) if text_rows else None,
                                  torch.cat(audio_rows, 0) if audio_rows else None)

    def encode_audio(self, wave: torch.Tensor) -> torch.Tensor:
        """Codec encode of (C, S) float32 at 48 kHz: codes (Q, 1, F) int64 on the host."""
        with torch.no_grad():
            out = self.codec.encode(torch.as_tensor(wave, dtype=torch.float32)[None].to(self.device), return_dict=True)
        return out.audio_codes.cpu()

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codec decode of codes (Q, 1, F): waveform (1, C, S) float32 on the host."""
        with torch.no_grad():
            out = self.codec.decode(torch.as_tensor(codes, dtype=torch.long).to(self.device), return_dict=True)
        return out.audio.float().cpu()


def load_upstream(model_dir_or_id: str, codec_dir_or_id: Optional[str] = None, *, device: torch.device,
                  dtype: torch.dtype = torch.float32, code_dir: Optional[str] = None,
                  attn_implementation: Optional[str] = None, patches: Optional[PatchSet] = None) -> UpstreamTTS:
    """Load the official TTS and codec remote code with the patch set, on ``device`` in ``dtype``.

    The folders (or hub ids) are never modified: patched copies of their configs live in a temporary folder
    while the objects load. The official code comes from ``code_dir`` (searched below it) or the model folders.
    ``attn_implementation`` goes through ``moss_npu.device.attention_impl`` (the official codec is always sdpa).
    ConfigError without transformers or the patch manifest; CheckpointError when a folder or the official code is
    missing, or the code is not the revision the patch set was written for."""
    patches = load_manifest() if patches is None else patches
    transformers = import_transformers()
    model_dir = resolve_model_dir(model_dir_or_id, role="TTS model")
    codec_dir = resolve_model_dir(codec_dir_or_id or DEFAULT_CODEC, role="codec", example=DEFAULT_CODEC)
    code = None if code_dir is None else Path(code_dir)
    impl = attention_impl(attn_implementation)
    warn_if_bf16_is_emulated(device, dtype, "the official code in bfloat16")
    with tempfile.TemporaryDirectory(prefix="moss_npu_upstream_") as work, _torchaudio_stand_in():
        tts_mirror = mirror_folder("tts", model_dir, Path(work), patches, attn_implementation=impl, code_dir=code)
        # The official codec knows only sdpa and flash_attention_2 (it raises on eager), and runs in fp32.
        codec_mirror = mirror_folder("codec", codec_dir, Path(work), patches,
                                     attn_implementation=attention_impl(), code_dir=code)
        common = {"trust_remote_code": True, "local_files_only": True}
        # transformers 4.57 replaces config.json's attn_implementation by this argument (None when absent).
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tts_mirror), dtype=dtype, attn_implementation=impl, **common)
        codec = transformers.AutoModel.from_pretrained(str(codec_mirror), **common)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tts_mirror), use_fast=False, **common)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # as the official _load_text_tokenizer does
    model.eval().to(device)
    codec.eval().to(device)
    _check_attention(model, impl, patches)
    return UpstreamTTS(model, codec, tokenizer, device=device, dtype=dtype, patches=patches)


def import_transformers() -> types.ModuleType:
    """Import transformers, or raise ConfigError naming the install command (also when it is too old)."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"--impl upstream needs transformers (the official code runs on it): {_INSTALL_HINT}") from exc
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if major_minor < _MIN_TRANSFORMERS:
        # Older releases ignore from_pretrained(dtype=...) and predate the official code (4.57.1).
        raise ConfigError(f"--impl upstream needs transformers >= 4.57, found {transformers.__version__}: {_INSTALL_HINT}")
    return transformers


@contextlib.contextmanager
def _torchaudio_stand_in() -> Iterator[None]:
    """While the official code is imported, answer ``import torchaudio`` with the moss_npu stand-in.

    The official module imports torchaudio at import time only to load/save audio, which the patch set
    routes through moss_npu.audio; this keeps a missing or broken (torchcodec-less) torchaudio harmless.
    """
    previous = sys.modules.get("torchaudio")
    sys.modules["torchaudio"] = audio_io_module()
    try:
        yield
    finally:
        if previous is None:
            sys.modules.pop("torchaudio", None)
        else:
            sys.modules["torchaudio"] = previous


def _check_attention(model: Any, impl: str, patches: PatchSet) -> None:
    """Raise CheckpointError unless every official attention module really runs ``impl`` after loading."""
    found = {name: module.attn_implementation for name, module in model.named_modules() if hasattr(module, "attn_implementation")}
    wrong = {name or "model": value for name, value in found.items() if value != impl}
    if not found or wrong:
        raise CheckpointError(f"the official model does not run the patched attention "
                              f"({wrong or 'no attention modules'}, wanted {impl}); the patch set was written against "
                              f"{patches.code_repo}@{patches.revision}: use that code or update patches/manifest.yaml")


def _host(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float32)


@contextlib.contextmanager
def _output_path(path: Optional[str]) -> Iterator[str]:
    if path is not None:
        yield str(path)
        return
    with tempfile.TemporaryDirectory(prefix="moss_npu_upstream_out_") as folder:
        yield str(Path(folder) / "out.wav")
