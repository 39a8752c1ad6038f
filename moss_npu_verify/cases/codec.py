"""Conformance handlers for the codec and reference-audio cases of a nano fixture (``python -m moss_npu_verify.goldens``).

Kinds: ``load_reference_audio`` (max abs <= 1e-5), ``codec_encode`` (codes identical), ``codec_decode``
(SNR >= 60 dB), the tolerances of the fixture README. The codec is ``fx.root / "codec"``, loaded once per
run on CPU in fp32, as the official goldens were made.
"""

from __future__ import annotations

import numpy as np
import torch

from moss_npu.accuracy import max_abs, snr_db
from moss_npu.audio import load_reference_audio
from moss_npu.codec.checkpoint import load_codec
from moss_npu.codec.model import NanoCodec
from moss_npu_verify.goldens import CaseResult, Fixture

REFERENCE_MAX_ABS = 1e-5
DECODE_MIN_SNR_DB = 60.0


def _codec(fx: Fixture) -> NanoCodec:
    return fx.memo("codec", lambda: load_codec(fx.root / "codec", device="cpu", dtype=torch.float32))


def check_load_reference_audio(case: dict, fx: Fixture) -> CaseResult:
    """Load and resample the reference recording; compare the first ``truncate_seconds`` with the golden."""
    rate = int(case.get("target_sample_rate", 48000))
    wave = load_reference_audio(fx.path(case["path"]), rate, int(case.get("target_channels", 2))).numpy()
    expected = np.load(fx.path(case["expected"]))
    if "truncate_seconds" in case:
        wave = wave[:, : int(round(float(case["truncate_seconds"]) * rate))]
    if wave.shape != expected.shape:
        return CaseResult(False, f"shape {wave.shape} != expected {expected.shape}")
    err = max_abs(wave, expected)
    return CaseResult(err <= REFERENCE_MAX_ABS, f"max_abs={err:.3g}")


def check_codec_encode(case: dict, fx: Fixture) -> CaseResult:
    """Encode the golden waveform; codes must be identical and lengths equal."""
    wave = torch.from_numpy(np.load(fx.path(case["input"]))).float()
    expected = np.load(fx.path(case["expected"]))
    codes, lengths = _codec(fx).encode(wave[None] if wave.dim() == 2 else wave)
    codes = codes.cpu().numpy()
    if codes.shape != expected.shape:
        return CaseResult(False, f"codes shape {codes.shape} != expected {expected.shape}")
    mismatches = int((codes != expected).sum())
    lengths_ok = "expected_lengths" not in case or lengths.cpu().tolist() == list(case["expected_lengths"])
    return CaseResult(mismatches == 0 and lengths_ok,
                      f"mismatched_codes={mismatches}/{codes.size} lengths={lengths.cpu().tolist()}")


def check_codec_decode(case: dict, fx: Fixture) -> CaseResult:
    """Decode the golden codes; the waveform must reach the SNR bound against the golden."""
    codes = torch.from_numpy(np.load(fx.path(case["input"]))).long()
    expected = np.load(fx.path(case["expected"]))
    audio, _ = _codec(fx).decode(codes)
    audio = audio.cpu().numpy()
    if audio.shape != expected.shape:
        return CaseResult(False, f"audio shape {audio.shape} != expected {expected.shape}")
    snr = snr_db(audio, expected)
    return CaseResult(snr >= DECODE_MIN_SNR_DB, f"snr_db={snr:.1f}")
