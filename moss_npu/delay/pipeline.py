"""The Delay text-to-speech pipeline: text (+ reference voice) -> 24 kHz waveform via llama.cpp
(docs/delay.md#pipeline, with the guards the official code lacks). S prompt rows, Q codebooks, H hidden size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from moss_npu.delay.backbone import LlamaBackbone
from moss_npu.delay.codec_onnx import OnnxCodec
from moss_npu.delay.config import DelayRunConfig
from moss_npu.sampling_params import SamplingParams
from moss_npu.delay.embeddings import DelayEmbeddings
from moss_npu.delay.heads import build_audio_heads
from moss_npu.delay.prompt import DelayTokenizer, build_prompt, parse_text
from moss_npu.delay.reference import load_reference, loudness_normalize
from moss_npu.delay.state import frames_from_rows, init_state, step
from moss_npu.delay.weights import DelayWeights
from moss_npu.errors import CheckpointError, ConfigError, GenerationError, InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """What one utterance produced before the codec.

    ``rows``: ``(steps, 1 + Q)`` every generated row (the ``<|im_end|>`` row included);
    ``codes``: ``(T, Q)`` frames for the codec; ``hidden`` ``(steps, H)`` and ``text_logits`` ``(steps, V)``
    only when recorded.
    """

    prompt: np.ndarray
    rows: np.ndarray
    codes: np.ndarray
    stopped_on_im_end: bool
    text: str
    max_new_tokens: int
    hidden: Optional[np.ndarray] = None
    text_logits: Optional[np.ndarray] = None


class DelayPipeline:
    """MOSS-TTS Delay on llama.cpp: tokenizer, embeddings, backbone, audio heads and (optionally) the codec."""

    def __init__(self, weights: DelayWeights, run: DelayRunConfig, codec: Optional[OnnxCodec] = None) -> None:
        self.weights, self.run, self.codec = weights, run, codec
        self.config = weights.config
        if codec is not None and codec.sample_rate_hz != self.config.sampling_rate:
            raise CheckpointError(f"config.json sampling_rate={self.config.sampling_rate} but the ONNX codec runs at "
                                  f"{codec.sample_rate_hz} Hz; use the MOSS-Audio-Tokenizer that matches the model")
        self.tokenizer = DelayTokenizer(weights.tokenizer_json, self.config)
        self.embeddings = DelayEmbeddings(weights)
        self.heads = build_audio_heads(weights, run.heads_backend, run.heads_device)
        self.backbone = LlamaBackbone(weights.gguf, run)
        if self.backbone.n_embd != weights.hidden_size:
            self.backbone.close()
            raise CheckpointError(f"{weights.gguf}: hidden size {self.backbone.n_embd} but the embedding tables have "
                                  f"{weights.hidden_size}; GGUF and .npy files come from different checkpoints")

    @classmethod
    def open(cls, run: DelayRunConfig, weights_dir: Union[str, Path],
             codec_onnx_dir: Optional[Union[str, Path]] = None) -> "DelayPipeline":
        """Build from a finished run config, a weights folder and an optional codec folder."""
        weights = DelayWeights.open(weights_dir, run.backbone_gguf)
        codec = (OnnxCodec(codec_onnx_dir, run.audio_provider, run.device_index)
                 if codec_onnx_dir is not None else None)
        return cls(weights, run, codec)

    def close(self) -> None:
        """Free the llama.cpp model and context."""
        self.backbone.close()

    def __enter__(self) -> "DelayPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, text: str, reference_codes: Optional[np.ndarray] = None, *, instruction: Optional[str] = None,
                 tokens: Optional[int] = None, quality: Optional[str] = None, language: Optional[str] = None,
                 max_new_tokens: Optional[int] = None, seed: Optional[int] = None,
                 sampling: Optional[SamplingParams] = None, record: bool = False,
                 on_step: Optional[Callable[[int], None]] = None) -> Generation:
        """Generate the codes of one utterance (no codec), in the voice of ``reference_codes`` ``(T, Q)`` if given.

        ``seed`` seeds a fresh ``RandomState`` (upstream's ``np.random.seed`` stream); ``sampling`` overrides the
        run's for this call; ``record`` keeps every step's hidden state and text logits; ``on_step`` is called with
        the steps taken after each (progress). ``InputError`` when the prompt alone does not fit ``n_ctx``.
        """
        prompt = build_prompt(self.tokenizer, text, reference_codes, instruction=instruction, tokens=tokens,
                              quality=quality, language=language)
        limit = self._cap_new_tokens(prompt.shape[0], max_new_tokens)
        rng = np.random.RandomState(seed)
        sampling = sampling if sampling is not None else self.run.sampling
        state = init_state(prompt, self.config)
        self.backbone.clear()
        self.backbone.prefill(self.embeddings(prompt))
        rows, hidden_seen, logits_seen = [], [], []
        for index in range(limit):
            logits = self.backbone.text_logits()
            hidden = self.backbone.hidden_state()
            if record:
                hidden_seen.append(hidden)
                logits_seen.append(logits)
            row = step(state, logits, self.heads(hidden), sampling, self.config, rng)
            rows.append(row)
            if on_step is not None:
                on_step(index + 1)
            if state.is_stopping or index == limit - 1:
                break  # nothing reads the outputs of the last row, so it is not fed
            self.backbone.step(self.embeddings(row), prompt.shape[0] + index)
        generated = np.stack(rows) if rows else np.zeros((0, prompt.shape[1]), dtype=np.int64)
        return Generation(
            prompt=prompt, rows=generated, codes=frames_from_rows(generated, self.config),
            stopped_on_im_end=state.is_stopping, text=parse_text(self.tokenizer, generated[:, 0].tolist()),
            max_new_tokens=limit, hidden=np.stack(hidden_seen) if record and rows else None,
            text_logits=np.stack(logits_seen) if record and rows else None)

    def synthesize(self, text: str, reference_audio: Optional[Union[str, Path, np.ndarray]] = None, *,
                   instruction: Optional[str] = None, tokens: Optional[int] = None, quality: Optional[str] = None,
                   language: Optional[str] = None, max_new_tokens: Optional[int] = None,
                   max_new_frames: Optional[int] = None, seed: Optional[int] = None,
                   on_step: Optional[Callable[[int], None]] = None) -> tuple[np.ndarray, int]:
        """Speak ``text``, optionally in the voice of ``reference_audio`` (a file, or 24 kHz mono samples); return
        ``(waveform, sample_rate)``, ``(1, S)`` float32 at 24 kHz, loudness-normalised like upstream.

        ``max_new_frames`` caps the audio at that many frames: a frame is complete once the staircase has produced
        its last codebook, so it allows ``frames + Q - 1`` steps (at most ``max_new_tokens`` when both are given).
        Raises ``ConfigError`` without a codec, ``GenerationError`` when the model ends before its first audio
        frame, ``InputError`` when the step cap does (``max_new_tokens`` below the staircase).
        """
        codec = self._need_codec()
        codes = None if reference_audio is None else codec.encode(self._reference_wave(reference_audio))
        if max_new_frames is not None:
            frame_steps = int(max_new_frames) + self.config.n_vq - 1
            max_new_tokens = frame_steps if max_new_tokens is None else min(int(max_new_tokens), frame_steps)
        result = self.generate(text, codes, instruction=instruction, tokens=tokens, quality=quality,
                               language=language, max_new_tokens=max_new_tokens, seed=seed, on_step=on_step)
        if result.codes.shape[0] == 0 and result.stopped_on_im_end:  # a valid run: the CLIs' exit 1
            raise GenerationError("the model stopped before any audio; try another --seed")
        if result.codes.shape[0] == 0:  # the step cap cut the staircase short: bad settings
            raise InputError(f"no audio frame after {result.rows.shape[0]} steps (max_new_tokens="
                             f"{result.max_new_tokens}); allow at least {self.config.n_vq + 1} steps")
        wave = loudness_normalize(codec.decode(result.codes))
        return wave[None, :], codec.sample_rate_hz

    def _cap_new_tokens(self, prompt_rows: int, requested: Optional[int]) -> int:
        requested = self.run.max_new_tokens if requested is None else int(requested)
        if requested < 1:
            raise InputError(f"max_new_tokens={requested}: must be >= 1")
        room = self.backbone.n_ctx - prompt_rows
        if room < 1:
            raise InputError(f"the prompt has {prompt_rows} rows but n_ctx={self.backbone.n_ctx}; shorten the text or "
                             "reference audio, or raise n_ctx")
        if requested > room:
            log.warning("max_new_tokens %d capped to %d: n_ctx=%d minus %d prompt rows", requested, room,
                        self.backbone.n_ctx, prompt_rows)
        return min(requested, room)

    def _need_codec(self) -> OnnxCodec:
        if self.codec is None:
            raise ConfigError("synthesis needs the ONNX codec; pass --codec-onnx-dir with encoder.onnx and decoder.onnx")
        return self.codec

    def _reference_wave(self, reference: Union[str, Path, np.ndarray]) -> np.ndarray:
        if isinstance(reference, np.ndarray):
            wave = reference.reshape(-1) if reference.ndim == 2 and reference.shape[0] == 1 else reference
            if wave.ndim != 1:
                raise InputError(f"reference audio array of shape {reference.shape}; pass mono (samples,) at 24 kHz")
        else:
            wave = load_reference(reference, self._need_codec().sample_rate_hz)
        return loudness_normalize(wave)
