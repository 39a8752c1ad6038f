"""Conformance handlers for the end-to-end kinds ``inference`` and ``inference_stream`` (nano fixtures).

The official ``model.inference`` runs with the model-API defaults (greedy, 300 frames, 50-token chunks),
so those are the base settings here and each case's ``params`` override them.
"""

from __future__ import annotations

import numpy as np
import torch

from moss_npu.accuracy import snr_db
from moss_npu_verify.goldens import CaseResult, Fixture
from moss_npu.tts.pipeline import MossTTSNano
from moss_npu.tts.settings import RunConfig

MODEL_API_DEFAULTS = dict(do_sample=False, text_temperature=1.5, text_top_p=1.0, text_top_k=50,
                          audio_temperature=1.7, audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.0,
                          max_new_frames=300, voice_clone_max_text_tokens=50,
                          text_normalization=False, wetext=False)  # model.inference reads the text as given
MIN_SNR_DB = 60.0
# Official inference arguments that cannot change a CPU run's output, so the pipeline has no setting for them.
NO_EFFECT_ON_CPU = {
    "codec_max_batch_size": "the codec decodes each chunk alone on CPU; batching only pads",
    "voice_clone_max_memory_per_sample_gb": "chunk batching is sized from memory only on accelerators",
    "use_kv_cache": "the cache changes how the same numbers are computed, not the numbers",
    "tts_max_batch_size": "the official code batches chunks only on CUDA: on CPU this caps a batch of 1",
}


def _pipeline(fx: Fixture) -> MossTTSNano:
    return fx.memo("tts_pipeline", lambda: MossTTSNano.from_pretrained(
        str(fx.root / "tts"), str(fx.root / "codec"), device="cpu"))


def _request(case: dict, fx: Fixture) -> tuple[dict, RunConfig]:
    params = {k: v for k, v in case.get("params", {}).items() if k not in NO_EFFECT_ON_CPU}
    settings = RunConfig(**{**MODEL_API_DEFAULTS, "mode": case["mode"], **params})
    audio = case.get("prompt_audio_path")
    kwargs = dict(text=case["text"], prompt_audio=fx.path(audio) if audio else None,
                  prompt_text=case.get("prompt_text"), settings=settings)
    if case.get("seed") is not None:
        torch.manual_seed(int(case["seed"]))  # as the official run did right before the call
    return kwargs, settings


def check_inference(case: dict, fx: Fixture) -> CaseResult:
    """Codes identical, text chunks identical, waveform >= 60 dB SNR against the official output."""
    kwargs, _ = _request(case, fx)
    result = _pipeline(fx).synthesize(**kwargs)
    expected_codes = np.load(fx.path(case["expected_codes"]))
    expected_wave = np.load(fx.path(case["expected_wave"]))
    problems = []
    if result.sample_rate != case["expected_sample_rate"]:
        problems.append(f"sample_rate {result.sample_rate} != {case['expected_sample_rate']}")
    if "expected_text_chunks" in case and result.text_chunks != case["expected_text_chunks"]:
        problems.append(f"text chunks differ: {result.text_chunks}")
    if result.codes.shape != expected_codes.shape or not np.array_equal(result.codes.numpy(), expected_codes):
        problems.append(f"codes differ (got {tuple(result.codes.shape)}, want {expected_codes.shape})")
    if tuple(result.waveform.shape) != expected_wave.shape:
        return CaseResult(False, "; ".join(problems + [f"waveform shape {tuple(result.waveform.shape)} != {expected_wave.shape}"]))
    snr = snr_db(result.waveform, expected_wave)
    if snr < MIN_SNR_DB:
        problems.append(f"snr_db={snr:.1f} < {MIN_SNR_DB}")
    return CaseResult(not problems, "; ".join(problems) or f"codes identical, {len(result.text_chunks)} chunk(s), snr_db={snr:.1f}")


def check_inference_stream(case: dict, fx: Fixture) -> CaseResult:
    """The concatenated stream is >= 60 dB SNR against the official stream (chunk sizes are not compared)."""
    kwargs, _ = _request(fx.case(case["of"]), fx)
    tts = _pipeline(fx)
    chunks = list(tts.synthesize_stream(**kwargs))
    wave = torch.cat([c.waveform for c in chunks], dim=1) if chunks else torch.zeros(tts.codec.channels, 0)
    expected = np.load(fx.path(case["expected_wave"]))
    if tuple(wave.shape) != expected.shape:
        return CaseResult(False, f"stream shape {tuple(wave.shape)} != {expected.shape}")
    snr = snr_db(wave, expected)
    return CaseResult(snr >= MIN_SNR_DB, f"snr_db={snr:.1f} over {len(chunks)} chunks")
