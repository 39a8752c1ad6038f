"""One side of an accuracy comparison: a model on one device, run over fixed inputs, results kept on the host.

The reference side builds the fixed inputs (prompt rows, voice-reference codes, one teacher-forced frame, codec
codes) and the codes tier B decodes; the target side reuses them, so both compute the same functions of the same
inputs. ``NativeSide`` runs this package, ``UpstreamSide`` the official code (``moss_npu.upstream.UpstreamTTS``).
Shapes: L prompt rows, E hidden, Q = n_vq channels, V codebook size, F frames, C channels, S samples.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from moss_npu import device as devices
from moss_npu.errors import InputError
from moss_npu.tts.loop import generate
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.cpu.quantize import dtype_name
from moss_npu.sampling import SamplingParams

FIXED_CODEC_FRAMES = 8
STREAM_PIECES = (1, 2, 4, 8)  # frames per streaming decode call, growing as the playback schedule grows them


@dataclass(frozen=True)
class EvalInput:
    """One request to compare: a short text (one prompt, no long-text chunking) and an optional voice reference."""

    label: str
    text: str
    prompt_audio: Optional[Path] = None

    @property
    def mode(self) -> str:
        """``voice_clone`` with a voice reference, else plain ``continuation``."""
        return "voice_clone" if self.prompt_audio is not None else "continuation"


DEFAULT_INPUTS = (
    EvalInput("zh", "今天天气很好，我们一起去公园散步吧。"),
    EvalInput("en", "The quick brown fox jumps over the lazy dog."),
)


@dataclass(frozen=True)
class SideSpec:
    """Which implementation to load where: ``role`` is ``reference`` or ``target``, ``impl`` native or upstream;
    ``code_dir``: where an upstream side's official ``*.py`` code lives (None: the model folders)."""

    role: str
    impl: str
    device: torch.device
    dtype: torch.dtype
    model: str
    codec: str
    code_dir: Optional[str] = None
    quantize: str = "none"  # native sides: "int8" rounds the LM's block weights (moss_npu.cpu.quantize)

    def __post_init__(self) -> None:
        if self.impl not in ("native", "upstream"):
            raise InputError(f"--impl {self.impl}: unknown; use native or upstream")
        if self.quantize != "none" and self.impl != "native":
            raise InputError("--quantize applies to the native implementation; drop it with --impl upstream")


@dataclass(frozen=True)
class GenerationSettings:
    """Free-running generation of tier C. ``rng`` is where random numbers come from: ``host`` (a seeded CPU
    generator: identical draws on every device), ``device`` (each side's, seeded like the official runtime: one
    device only) or ``none`` (greedy)."""

    max_new_frames: int
    sampling: SamplingParams
    seed: int
    rng: str


@dataclass
class InputCapture:
    """What one side computed for one input; tensors are float32 or int64 on the host, None = not available."""

    rows: torch.Tensor  # (L, Q + 1) the prompt rows both sides run (the reference's)
    own_rows: Optional[torch.Tensor] = None  # (L', Q + 1) the rows this side builds from the text itself
    prompt_codes: Optional[torch.Tensor] = None  # (F, Q) this side's encoding of the voice reference
    tensors: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # tier A and B outputs by name
    codes: Optional[torch.Tensor] = None  # (F, Q) generated codes (tier C)
    fixed_codes: Optional[torch.Tensor] = None  # (F, Q) the reference's greedy codes, decoded by both sides (tier B)
    text_logits: Optional[torch.Tensor] = None  # (steps, 2) [continue, stop] logits of every text decision
    audio_logits: Optional[torch.Tensor] = None  # (F·Q, V) logits of every audio decision, in order
    stream_wave: Optional[torch.Tensor] = None  # (C, S) own codes decoded as streamed (only when equal to the reference's)
    error: Optional[str] = None  # why generation failed (non-finite logits)


@dataclass
class Capture:
    """Everything one side computed, the fixed inputs it used, and which side it was."""

    side: dict[str, Any]
    frame_row: torch.Tensor  # (Q + 1,) the teacher-forced row: [continue id, the frame's Q tokens]
    codec_codes: torch.Tensor  # (F, Q) codes for the codec decoder check
    tensors: dict[str, Optional[torch.Tensor]]  # input-independent outputs ("codec_decode")
    inputs: dict[str, InputCapture]


def _host(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float32).clone()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class NativeSide:
    """This package's pipeline (LM + codec) on one device."""

    impl = "native"

    def __init__(self, tts: Any) -> None:
        self.tts = tts

    @classmethod
    def load(cls, model: str, codec: str, device: torch.device, dtype: torch.dtype,
             quantize: str = "none") -> "NativeSide":
        """Load the LM in ``dtype`` (``quantize``d) and the codec (fp32, as the official code keeps it) on ``device``."""
        from moss_npu.tts.pipeline import MossTTSNano

        return cls(MossTTSNano.from_pretrained(model, codec, device=str(device), dtype=_dtype_name(dtype),
                                               quantize=quantize))

    @property
    def device(self) -> torch.device:
        return self.tts.device

    def describe(self) -> dict[str, Any]:
        """Implementation, dtypes and the device's name and versions (``moss_npu.device.describe``)."""
        codec_dtype = next(self.tts.codec.parameters()).dtype
        info = {"impl": self.impl, "dtype": dtype_name(self.tts.model), "compute_dtype": _dtype_name(self.tts.model.dtype),
                "codec_dtype": _dtype_name(codec_dtype), "quantize": self.tts.model.quantization,
                **devices.describe(self.device)}
        kernels = devices.backend(self.device).kernel_report()  # the CPU's one-row kernels' instruction set
        if kernels is not None:
            info["cpu_kernels"] = kernels
        return info

    def close(self) -> None:
        """Drop the model and codec and give the device's cached memory back."""
        dev = self.device
        self.tts = None
        gc.collect()
        devices.empty_cache(dev)

    def capture(self, inputs: Sequence[EvalInput], settings: GenerationSettings,
                reference: Optional[Capture] = None) -> Capture:
        """Run every check on every input; without ``reference`` this side makes the fixed inputs itself."""
        cfg, codec = self.tts.config, self.tts.codec
        if reference is None:
            gen = torch.Generator().manual_seed(settings.seed)
            tokens = [torch.randint(0, n, (1,), generator=gen) for n in cfg.audio_codebook_sizes]
            frame = torch.cat([torch.tensor([cfg.audio_assistant_slot_token_id])] + tokens)
            codec_codes = torch.randint(0, codec.codebook_size, (FIXED_CODEC_FRAMES, cfg.n_vq), generator=gen)
        else:
            frame, codec_codes = reference.frame_row, reference.codec_codes
        per_input = {}
        for item in inputs:
            ref = None if reference is None else reference.inputs[item.label]
            per_input[item.label] = self._capture_input(item, settings, frame, ref)
        return Capture(self.describe(), frame, codec_codes, {"codec_decode": self._decode(codec_codes)}, per_input)

    def _capture_input(self, item: EvalInput, settings: GenerationSettings, frame: torch.Tensor,
                       ref: Optional[InputCapture]) -> InputCapture:
        cfg = self.tts.config
        own_codes = None if item.prompt_audio is None else self.tts.reference_codes(item.prompt_audio).clone()
        shared_codes = own_codes if ref is None else ref.prompt_codes
        own_rows = build_prompt_rows(self.tts.tokenizer, cfg, item.text, item.mode, None, shared_codes)
        cap = InputCapture(rows=own_rows if ref is None else ref.rows, own_rows=own_rows, prompt_codes=own_codes)
        cap.tensors.update(self._teacher_forced(cap.rows, frame))
        self._generate(cap, settings)
        if ref is None:
            # Tier B decodes greedy codes: they exist whatever the sampled run of tier C did (it may stop at once).
            cap.fixed_codes = (cap.codes if settings.rng == "none"
                               else self._codes(cap.rows, settings.max_new_frames, sampling=SamplingParams())[0])
            if cap.codes is not None and len(cap.codes):
                cap.tensors["generated_wave"] = self._decode(cap.codes)
        else:
            cap.fixed_codes = ref.fixed_codes
        fixed = cap.fixed_codes
        cap.tensors["decoded_codes"] = self._decode(fixed) if fixed is not None and len(fixed) else None
        if ref is not None and _same(cap.codes, ref.codes) and len(cap.codes):
            cap.stream_wave = self._decode_streamed(cap.codes)
        return cap

    @torch.no_grad()
    def _teacher_forced(self, rows: torch.Tensor, frame: torch.Tensor) -> dict[str, torch.Tensor]:
        """Global hidden states of the prompt, the local frame given ``frame``'s tokens, one cached decode step."""
        model, q = self.tts.model, self.tts.config.n_vq
        dev = model.device
        x = rows[None].to(dev)
        hidden = model(x)  # (1, L, E)
        frame = frame.to(dev)
        tokens = frame[1:]
        # Local sequence of a frame: global hidden, wte[continue], then the embeddings of channels 0..Q-2.
        pieces = [hidden[0, -1:], model.transformer.wte(frame[:1])]
        pieces += [model.audio_embeddings[c](tokens[c:c + 1]) for c in range(q - 1)]
        seq = torch.cat([p.to(model.dtype) for p in pieces])[None]  # (1, Q + 1, E)
        local = model.local_transformer(seq, torch.ones(seq.shape[:2], dtype=torch.bool, device=dev))
        audio_logits = torch.stack([model.audio_lm_heads[c](local[0, c + 1]) for c in range(q)])  # (Q, V)
        length = rows.shape[0]
        cache = model.transformer.init_cache(1, length + 1)
        mask = torch.ones(1, length + 1, dtype=torch.bool, device=dev)
        model(x, mask[:, :length], cache)
        step = model(frame[None, None], mask, cache)  # (1, 1, E)
        return {"global_hidden": _host(hidden[0]), "text_logits": _host(model.text_lm_head(local[0, 0])),
                "local_hidden": _host(local[0]), "audio_logits": _host(audio_logits),
                "decode_step_hidden": _host(step[0, 0])}

    def _generate(self, cap: InputCapture, settings: GenerationSettings) -> None:
        model = self.tts.model
        seen: dict[str, list[torch.Tensor]] = {"text": [], "audio": []}

        def record(kind: str, index: int, logits: torch.Tensor) -> None:
            seen[kind].append(_host(logits[0]))

        generator = torch.Generator().manual_seed(settings.seed) if settings.rng == "host" else None
        if settings.rng == "device":
            devices.seed_everything(settings.seed, model.device)
        cap.codes, cap.error = self._codes(cap.rows, settings.max_new_frames, sampling=settings.sampling,
                                           generator=generator, host_rng=settings.rng == "host", logits_hook=record)
        if cap.codes is None:
            return
        vocab = model.config.audio_codebook_sizes[0]
        cap.text_logits = torch.stack(seen["text"]) if seen["text"] else torch.zeros(0, 2)
        cap.audio_logits = torch.stack(seen["audio"]) if seen["audio"] else torch.zeros(0, vocab)

    def _codes(self, rows: torch.Tensor, max_new_frames: int,
               **options: Any) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """Codes (F, Q) generated from the prompt rows, or None and the message where low precision made the logits
        non-finite (a finding, not a crash)."""
        model = self.tts.model
        try:
            return generate(model, rows.to(model.device), max_new_frames=max_new_frames, **options).codes[0].cpu(), None
        except RuntimeError as exc:
            if "Non-finite" not in str(exc):
                raise
            return None, str(exc)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode codes (F, Q) in one call; return (C, S) on the host."""
        codec = self.tts.codec
        nq = min(codes.shape[1], codec.num_quantizers)
        audio, lengths = codec.decode(codes[:, :nq].T[:, None, :])
        return _host(audio[0, :, : int(lengths[0])])

    def _decode_streamed(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode codes (F, Q) through the streaming decoder in growing pieces, as ``synthesize_stream`` does."""
        codec = self.tts.codec
        nq = min(codes.shape[1], codec.num_quantizers)
        state = codec.init_decode_state(1, max(STREAM_PIECES))
        out, start, i = [], 0, 0
        while start < codes.shape[0]:
            n = STREAM_PIECES[min(i, len(STREAM_PIECES) - 1)]
            out.append(codec.decode_step(codes[start:start + n, :nq].T[:, None, :], state)[0])
            start, i = start + n, i + 1
        return _host(torch.cat(out, dim=-1))


class UpstreamSide:
    """The official code (``moss_npu.upstream.UpstreamTTS``) on one device; it is always the target side."""

    impl = "upstream"

    def __init__(self, tts: Any, dtype: torch.dtype) -> None:
        self.tts, self.dtype = tts, dtype

    @classmethod
    def load(cls, model: str, codec: str, device: torch.device, dtype: torch.dtype,
             code_dir: Optional[str] = None) -> "UpstreamSide":
        """Load the official TTS and codec code with the patch set (raises ConfigError without transformers)."""
        from moss_npu.upstream import load_upstream

        return cls(load_upstream(model, codec, device=device, dtype=dtype, code_dir=code_dir), dtype)

    def describe(self) -> dict[str, Any]:
        """Implementation, dtypes, the official code's revision and the device's name and versions."""
        codec_dtype = next(self.tts.codec.parameters()).dtype
        info = {"impl": self.impl, "dtype": _dtype_name(self.dtype), "codec_dtype": _dtype_name(codec_dtype),
                **devices.describe(self.tts.device)}
        patches = getattr(self.tts, "patches", None)
        if patches is not None:
            info["code"] = f"{patches.code_repo}@{patches.revision}"
        return info

    def close(self) -> None:
        """Drop the official objects and give the device's cached memory back (``UpstreamTTS.close``)."""
        self.tts.close()
        self.tts = None
        gc.collect()

    def capture(self, inputs: Sequence[EvalInput], settings: GenerationSettings,
                reference: Optional[Capture] = None) -> Capture:
        """Run every check the official API allows on the reference's fixed inputs."""
        if reference is None:
            raise ValueError("the official code only runs as the target side; the reference side is native")
        if settings.rng == "host":
            raise ValueError("the official code cannot draw random numbers on the host; use rng 'device' or greedy")
        per_input = {item.label: self._capture_input(item, settings, reference.frame_row,
                                                     reference.inputs[item.label]) for item in inputs}
        codec_wave = self.tts.decode_codes(reference.codec_codes.T[:, None, :])[0]
        return Capture(self.describe(), reference.frame_row, reference.codec_codes,
                       {"codec_decode": _host(codec_wave)}, per_input)

    def _capture_input(self, item: EvalInput, settings: GenerationSettings, frame: torch.Tensor,
                       ref: InputCapture) -> InputCapture:
        tts = self.tts
        own_codes = None
        if item.prompt_audio is not None:
            codes = tts.encode_audio(tts.load_reference(str(item.prompt_audio)))[:, 0, :].T
            # The official encode keeps a trailing partial frame that its inference drops (floor lengths).
            own_codes = codes[: len(ref.prompt_codes)].clone()
        own_rows = tts.prompt_rows(item.text, item.mode, prompt_audio_codes=ref.prompt_codes)
        cap = InputCapture(rows=ref.rows, own_rows=own_rows.clone(), prompt_codes=own_codes)
        cap.tensors = dict(tts.teacher_forced(ref.rows, frame))
        sampling = {k: v for k, v in vars(settings.sampling).items() if k != "do_sample"}
        try:
            out = tts.generate_codes(ref.rows, max_new_frames=settings.max_new_frames,
                                     do_sample=settings.sampling.do_sample,
                                     seed=settings.seed if settings.rng == "device" else None,
                                     record_logits=True, **sampling)
        except RuntimeError as exc:  # the official non-finite check: a finding, not a crash
            if "Non-finite" not in str(exc):
                raise
            cap.error = str(exc)
        else:
            cap.codes = out.codes.to(torch.long)
            cap.text_logits = torch.zeros(0, 2) if out.text_logits is None else _host(out.text_logits)
            cap.audio_logits = (torch.zeros(0, ref.audio_logits.shape[-1]) if out.audio_logits is None
                                else _host(out.audio_logits))
        fixed = ref.fixed_codes
        cap.fixed_codes = fixed
        cap.tensors["decoded_codes"] = (_host(tts.decode_codes(fixed.T[:, None, :])[0])
                                        if fixed is not None and len(fixed) else None)
        if ref.codes is not None and len(ref.codes) and _same(cap.codes, ref.codes):
            # no streaming decode in the official API: its one-call decode stands in
            cap.stream_wave = _host(tts.decode_codes(ref.codes.T[:, None, :])[0])
        return cap


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))


def load_side(spec: SideSpec) -> Any:
    """Load the ``NativeSide`` or ``UpstreamSide`` that ``spec`` describes."""
    if spec.impl == "upstream":
        return UpstreamSide.load(spec.model, spec.codec, spec.device, spec.dtype, code_dir=spec.code_dir)
    return NativeSide.load(spec.model, spec.codec, spec.device, spec.dtype, spec.quantize)
