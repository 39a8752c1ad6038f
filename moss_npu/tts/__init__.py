"""The end-to-end MOSS-TTS-Nano pipeline: text (and a reference voice) in, 48 kHz stereo waveform out."""

from moss_npu.tts.pipeline import AudioChunk, MossTTSNano, SynthesisResult
from moss_npu.tts.settings import LoadConfig, RunConfig

__all__ = ["AudioChunk", "LoadConfig", "MossTTSNano", "RunConfig", "SynthesisResult"]
