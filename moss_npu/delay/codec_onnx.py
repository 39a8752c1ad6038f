"""The MOSS-Audio-Tokenizer codec of the Delay model, run by ONNX Runtime (docs/delay.md#codec: 24 kHz mono,
12.5 frames/s, graph inputs and outputs read by position). Here codes are always ``(T, Q)`` frames-first, so a
(32, 32) block is never ambiguous. S samples.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np

from moss_npu.errors import AudioError, CheckpointError, DeviceError, InputError

log = logging.getLogger(__name__)

FRAME_SAMPLES = 1920
N_QUANTIZERS = 32
CODEBOOK_SIZE = 1024


def import_onnxruntime():
    """Import onnxruntime, or raise ``DeviceError`` with the install command."""
    try:
        import onnxruntime
    except Exception as exc:  # a wheel for another CUDA/CANN can fail with OSError at import
        raise DeviceError(f"the ONNX codec needs onnxruntime (import failed: {exc}); install it with "
                          "`pip install onnxruntime` (or onnxruntime-gpu / onnxruntime-cann)") from exc
    return onnxruntime


def resolve_provider(kind: str) -> str:
    """Map ``auto`` or a device kind (``cpu``, ``cuda``, ``npu``/``cann``) to an installed execution provider (names
    from the device layer): ``auto`` takes the first installed accelerator provider, else the CPU one, and logs the
    choice. ``DeviceError`` for an unknown kind or a provider this onnxruntime build lacks."""
    from moss_npu.device import ONNX_PROVIDERS, onnx_provider, onnx_provider_wheel

    available = import_onnxruntime().get_available_providers()
    cpu = onnx_provider("cpu")
    if kind == "auto":
        accelerators = [p for p in dict.fromkeys(ONNX_PROVIDERS.values()) if p != cpu and p in available]
        chosen = accelerators[0] if accelerators else cpu
        log.info("audio_provider auto -> %s (installed: %s)", chosen, ", ".join(available))
        return chosen
    provider = onnx_provider(kind)
    if provider not in available:
        wheel = onnx_provider_wheel(provider)
        raise DeviceError(f"audio_provider={kind}: {provider} is not in this onnxruntime build (installed: "
                          f"{', '.join(available)}); `pip install {wheel}` or use audio_provider: cpu")
    return provider


class OnnxSession:
    """One ONNX graph on one execution provider (device ``device_id`` of it, if given), checked to run there."""

    def __init__(self, path: Path, provider: str, device_id: Optional[int] = None) -> None:
        ort = import_onnxruntime()
        if not Path(path).is_file():
            raise CheckpointError(f"codec graph {path} does not exist; download OpenMOSS-Team/MOSS-Audio-Tokenizer-ONNX "
                                  "(keep the external-data files beside the .onnx)")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # CPU stays as the per-node fallback ORT uses for ops a device provider lacks.
        providers: list = list(dict.fromkeys([provider, "CPUExecutionProvider"]))
        if device_id is not None and provider != "CPUExecutionProvider":
            providers[0] = (provider, {"device_id": str(device_id)})
        try:
            self.session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own (Fail, InvalidGraph, ...) exception types
            raise CheckpointError(f"{path}: onnxruntime cannot load it ({exc}); re-download the codec") from exc
        if self.session.get_providers()[0] != provider:
            # ORT quietly drops a provider whose libraries fail to load; a CPU run was not what was asked.
            raise DeviceError(f"{path}: {provider} failed to initialise (session runs on "
                              f"{self.session.get_providers()}); check the CUDA/CANN runtime or use audio_provider: cpu")
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        if len(self.inputs) != 2 or len(self.outputs) != 2:
            raise CheckpointError(f"{path}: {len(self.inputs)} inputs / {len(self.outputs)} outputs, expected 2 / 2 "
                                  "(MOSS-Audio-Tokenizer ONNX layout)")

    def run(self, first: np.ndarray, n_quantizers: int) -> list[np.ndarray]:
        """Run with the main input and the 0-d ``n_quantizers`` scalar; outputs in graph order."""
        feed = {self.inputs[0]: first, self.inputs[1]: np.array(n_quantizers, dtype=np.int64)}
        return self.session.run(self.outputs, feed)


class OnnxCodec:
    """Encoder and decoder sessions of the MOSS audio tokenizer."""

    sample_rate_hz = 24000

    def __init__(self, folder: Path | str, provider: str = "auto", device_id: Optional[int] = None) -> None:
        """Open ``encoder.onnx`` and ``decoder.onnx`` in ``folder`` (on accelerator ``device_id`` if given)."""
        provider = resolve_provider(provider)
        self.encoder = OnnxSession(Path(folder) / "encoder.onnx", provider, device_id)
        self.decoder = OnnxSession(Path(folder) / "decoder.onnx", provider, device_id)

    def encode(self, wave: np.ndarray) -> np.ndarray:
        """Encode a mono 24 kHz waveform ``(S,)`` (zero-padded to whole frames) to ``(T, Q)`` int64 codes."""
        wave = np.asarray(wave, dtype=np.float32)
        if wave.ndim != 1 or wave.size == 0:
            raise AudioError(f"reference waveform of shape {wave.shape}; expected a non-empty mono (samples,) array")
        padded = -(-wave.size // FRAME_SAMPLES) * FRAME_SAMPLES
        wave = np.pad(wave, (0, padded - wave.size))
        codes, lengths = self.encoder.run(wave[None, None, :], N_QUANTIZERS)
        if codes.ndim != 3 or codes.shape[:2] != (N_QUANTIZERS, 1):
            raise CheckpointError(f"encoder returned codes of shape {codes.shape}, expected ({N_QUANTIZERS}, 1, T)")
        return np.ascontiguousarray(codes[:, 0, : int(lengths[0])].T, dtype=np.int64)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Decode ``(T, Q)`` integer codes in 0..1023 (frames first, no pad) to ``(T * 1920,)`` float32 samples."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != N_QUANTIZERS or codes.shape[0] == 0 or codes.dtype.kind not in "iu":
            raise InputError(f"codes: {codes.dtype} array of shape {codes.shape}, expected integer "
                             f"(frames >= 1, {N_QUANTIZERS})")
        if codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
            raise InputError(f"codes in [{codes.min()}, {codes.max()}]: a pad or out-of-range code would index past "
                             f"the {CODEBOOK_SIZE}-entry codebooks; drop such frames before decoding")
        audio, lengths = self.decoder.run(np.ascontiguousarray(codes.T[:, None, :], dtype=np.int64), N_QUANTIZERS)
        if audio.ndim != 3 or audio.shape[:2] != (1, 1):
            raise CheckpointError(f"decoder returned audio of shape {audio.shape}, expected (1, 1, samples)")
        return np.asarray(audio[0, 0, : int(lengths[0])], dtype=np.float32)
