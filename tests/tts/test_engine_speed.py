"""The engine speaks at a request's speed, as the pipeline does (the one place speed is applied: ``tts.timeline``)."""

import pytest
import torch

from moss_npu_verify import goldens
from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.engine import Engine, SpeechRequest

NANO = goldens.fixtures_root() / "nano-tiny"


@pytest.mark.skipif(not NANO.is_dir(), reason=f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
@pytest.mark.parametrize("speed", [0.5, 1.5])
def test_engine_speaks_at_the_request_speed_like_the_pipeline(speed):
    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")
    settings = RunConfig(do_sample=False, max_new_frames=6, speed=speed, voice_clone_max_text_tokens=6)
    text = "First part of it. Second part here."
    reference = goldens.fixtures_root() / "nano-tiny" / "goldens" / "reference.wav"
    with Engine(tts, max_batch=1) as engine:
        chunks = list(engine.submit(SpeechRequest(text, prompt_audio=reference, settings=settings)))
    want = list(tts.synthesize_stream(text, prompt_audio=reference, settings=settings))
    wave, want_wave = (torch.cat([c.waveform for c in pieces], dim=1) for pieces in (chunks, want))
    assert wave.shape == want_wave.shape and torch.allclose(wave, want_wave, atol=1e-4)
    whole = tts.synthesize(text, prompt_audio=reference, settings=settings).waveform
    assert wave.shape == whole.shape  # the same length as the whole utterance at that speed
    assert sum(c.source_length for c in chunks) == sum(c.source_length for c in want)  # slicing follows the clock
