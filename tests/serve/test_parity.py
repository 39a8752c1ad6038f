"""The server says what the pipeline says: its codes and audio equal ``MossTTSNano.synthesize`` with the settings
the request asked for, for greedy and seeded-sampled runs, continuation with ``ref_text``, a stored voice with its
transcript, every response format, streamed audio and SSE.

Whole files carry the digest of the generated codes (``X-Codes-SHA256``), compared with the digest of the
pipeline's codes; streams carry no digest, so their samples are compared with the pipeline's waveform (16-bit
samples, two steps of slack for the codec's float rounding between streamed and one-shot decoding).

The engine behind the server samples every request from its own host generator with the noise-fed sampler, which
is what ``synthesize`` does with ``host_rng=True``; greedy runs do not sample. Each case also checks that the
setting it sends changes the pipeline's codes on this model, so a server that dropped it could not pass.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Optional

import numpy as np
import pytest
import soundfile
import torch

from moss_npu.audio import resample, to_channels
from tests.serve.conftest import MODEL, serve_module, tiny_dirs

serve_module("fastapi")

FRAMES = 8
TEXT = "Seeded words here."
# The request fields that reach RunConfig under the same name (written out here, not imported from the server,
# so that a server dropping one cannot drop it from the expectation too).
SAMPLING_FIELDS = ("text_temperature", "text_top_p", "text_top_k", "audio_temperature", "audio_top_p",
                   "audio_top_k", "audio_repetition_penalty")
# (extra body fields, the field under test). Two text candidates where "continue" leads by ~3 logits (the
# fixture's README): only a hot text temperature lets "stop" win, and top-k / top-p act on top of it.
SAMPLED_CASES = [
    ({"text_temperature": 3.0}, "text_temperature"),
    ({"text_temperature": 3.0, "text_top_k": 1}, "text_top_k"),
    ({"text_temperature": 3.0, "text_top_p": 0.1}, "text_top_p"),
    ({"audio_temperature": 1.5}, "audio_temperature"),
    ({"audio_top_p": 0.5}, "audio_top_p"),
    ({"audio_top_k": 3}, "audio_top_k"),
    ({"audio_repetition_penalty": 2.0}, "audio_repetition_penalty"),
]
TRANSCRIPT = "Some words."
# One request that sets everything at once: continuation from a recording, seeded sampling, non-default values.
CONTINUATION = {"model": MODEL, "input": "and then more words.", "ref_text": TRANSCRIPT, "seed": 11,
                "max_new_frames": FRAMES, "audio_top_k": 5, "audio_repetition_penalty": 1.5,
                "text_temperature": 1.3}


@pytest.fixture(scope="module")
def tts():
    from moss_npu.tts import MossTTSNano

    model, codec = tiny_dirs()
    return MossTTSNano.from_pretrained(str(model), str(codec), device="cpu")


@pytest.fixture(scope="module")
def reference() -> bytes:
    return (tiny_dirs()[0].parent / "goldens" / "reference.wav").read_bytes()


def settings_of(body: dict):
    """The pipeline's settings for a request body, as the API documents its fields."""
    from moss_npu.tts import RunConfig

    values = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    return RunConfig(max_new_frames=body["max_new_frames"], do_sample=not body.get("greedy", False),
                     seed=body.get("seed"), host_rng=True, **values)


def pipeline(tts, body: dict, prompt_audio: Optional[bytes] = None, prompt_text: Optional[str] = None):
    """``synthesize`` for ``body`` (with the recording and transcript the request names)."""
    return tts.synthesize(body["input"], prompt_audio=prompt_audio, prompt_text=prompt_text,
                          settings=settings_of(body))


def digest(codes: torch.Tensor) -> str:
    """The server's ``X-Codes-SHA256``: the first 16 hex digits of the SHA-256 of the int64 codes (F, Q)."""
    return hashlib.sha256(codes.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def int16(wave: torch.Tensor) -> np.ndarray:
    """(C, S) float audio as the (S, C) 16-bit samples the server sends."""
    return np.round(np.clip(wave.numpy().T, -1.0, 1.0) * 32767.0).astype(np.int64)


def assert_same_audio(got: np.ndarray, wave: torch.Tensor) -> None:
    """``got`` (S, C) int16 samples equal the pipeline's (C, S) waveform to two 16-bit steps."""
    want = int16(wave)
    assert got.shape == want.shape, (got.shape, want.shape)
    worst = int(np.abs(got.astype(np.int64) - want).max())
    assert worst <= 2, f"samples differ by up to {worst} 16-bit steps"


def pcm_samples(data: bytes, channels: int = 2) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").reshape(-1, channels)


def file_samples(data: bytes) -> np.ndarray:
    return soundfile.read(io.BytesIO(data), dtype="int16", always_2d=True)[0]


def sse_audio(http, body: dict) -> tuple[bytes, dict]:
    """POST an SSE request; return the joined audio of its deltas and the final event."""
    events = []
    with http.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    return b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), events[-1]


def streamed(http, body: dict) -> bytes:
    with http.stream("POST", "/v1/audio/speech", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()[:300]
        return b"".join(r.iter_bytes())


def speech(http, body: dict):
    answer = http.post("/v1/audio/speech", json=body)
    assert answer.status_code == 200, answer.text[:300]
    return answer


def test_greedy_whole_file_equals_the_pipeline(server, tts):
    body = {"model": MODEL, "input": "Hello there, my friend.", "greedy": True, "max_new_frames": FRAMES}
    want = pipeline(tts, body)
    with server.client() as http:
        answer = speech(http, {**body, "response_format": "wav"})
    assert answer.headers["x-codes-sha256"] == digest(want.codes)
    assert answer.headers["x-audio-frames"] == str(want.codes.shape[0])
    assert_same_audio(file_samples(answer.content), want.waveform)


@pytest.mark.parametrize("extra,field", SAMPLED_CASES, ids=[case[1] for case in SAMPLED_CASES])
def test_seeded_sampling_with_each_setting_equals_the_pipeline(server, tts, extra, field):
    body = {"model": MODEL, "input": TEXT, "seed": 7, "max_new_frames": FRAMES, **extra}
    want = pipeline(tts, body)
    without = pipeline(tts, {k: v for k, v in body.items() if k != field})
    assert digest(want.codes) != digest(without.codes), f"{field}={extra[field]} does not change the codes here"
    with server.client() as http:
        answer = speech(http, {**body, "response_format": "wav"})
    assert answer.headers["x-codes-sha256"] == digest(want.codes)
    assert_same_audio(file_samples(answer.content), want.waveform)


def test_continuation_with_ref_text_equals_the_pipeline(server, tts, reference):
    want = pipeline(tts, CONTINUATION, reference, TRANSCRIPT)
    clone = pipeline(tts, CONTINUATION, reference)  # the same recording without its transcript: voice clone
    assert want.mode == "continuation" and clone.mode == "voice_clone"
    assert digest(want.codes) != digest(clone.codes)
    body = {**CONTINUATION, "ref_audio": base64.b64encode(reference).decode()}
    with server.client() as http:
        answer = speech(http, {**body, "response_format": "flac"})
        dropped = speech(http, {k: v for k, v in body.items() if k != "ref_text"})
    assert answer.headers["x-codes-sha256"] == digest(want.codes)
    assert dropped.headers["x-codes-sha256"] == digest(clone.codes)
    assert_same_audio(file_samples(answer.content), want.waveform)


def test_stored_voice_with_transcript_equals_the_pipeline(server, tts, reference):
    body = {k: v for k, v in CONTINUATION.items() if k != "ref_text"}
    want = pipeline(tts, body, reference, TRANSCRIPT)
    clone = pipeline(tts, body, reference)
    assert digest(want.codes) != digest(clone.codes)
    with server.client() as http:
        worded = http.post("/v1/audio/voices", data={"name": "parity-worded", "transcript": TRANSCRIPT},
                           files={"audio": ("voice.wav", reference)}).json()
        plain = http.post("/v1/audio/voices", data={"name": "parity-plain"},
                          files={"audio": ("voice.wav", reference)}).json()
        try:
            spoken = speech(http, {**body, "voice": worded["id"]})
            streamed_pcm = streamed(http, {**body, "voice": "parity-worded", "response_format": "pcm"})
            cloned = speech(http, {**body, "voice": "parity-plain"})
            overridden = speech(http, {**body, "voice": "parity-plain", "ref_text": TRANSCRIPT})
        finally:
            for voice in (worded, plain):
                http.delete(f"/v1/audio/voices/{voice['id']}")
    assert spoken.headers["x-codes-sha256"] == digest(want.codes)
    assert_same_audio(file_samples(spoken.content), want.waveform)
    assert_same_audio(pcm_samples(streamed_pcm), want.waveform)
    assert cloned.headers["x-codes-sha256"] == digest(clone.codes)
    assert overridden.headers["x-codes-sha256"] == digest(want.codes)  # ref_text given with a stored voice


@pytest.fixture(scope="module")
def continuation(tts, reference):
    """The continuation request's body (with its recording) and the pipeline's result for it."""
    return {**CONTINUATION, "ref_audio": base64.b64encode(reference).decode()}, \
        pipeline(tts, CONTINUATION, reference, TRANSCRIPT)


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_every_whole_file_format_carries_the_pipeline_codes(server, continuation, fmt):
    body, want = continuation
    with server.client() as http:
        answer = speech(http, {**body, "response_format": fmt, "stream": False})
    assert answer.headers["x-codes-sha256"] == digest(want.codes)
    if fmt == "pcm":
        assert_same_audio(pcm_samples(answer.content), want.waveform)
    elif fmt in ("wav", "flac"):
        assert_same_audio(file_samples(answer.content), want.waveform)
    else:  # lossy: the codes decide; the decoded length is the utterance's, give or take the encoder's padding
        samples, rate = soundfile.read(io.BytesIO(answer.content), always_2d=True)
        assert rate == 48000 and abs(samples.shape[0] - want.waveform.shape[1]) <= 2 * 3840


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_streamed_audio_equals_the_pipeline(server, continuation, fmt):
    body, want = continuation
    with server.client() as http:
        data = streamed(http, {**body, "response_format": fmt})
    assert_same_audio(pcm_samples(data) if fmt == "pcm" else file_samples(data), want.waveform)


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_sse_audio_equals_the_pipeline(server, continuation, fmt):
    body, want = continuation
    with server.client() as http:
        data, done = sse_audio(http, {**body, "response_format": fmt})
    assert_same_audio(pcm_samples(data) if fmt == "pcm" else file_samples(data), want.waveform)
    assert done["usage"]["output_tokens"] == want.codes.shape[0]


def test_converted_stream_equals_the_converted_pipeline_audio(server, continuation):
    """Another rate and channel count: the server's chunked conversion of the same audio."""
    body, want = continuation
    with server.client() as http:
        data = streamed(http, {**body, "response_format": "pcm", "sample_rate": 24000, "channels": 1})
    assert_same_audio(pcm_samples(data, channels=1), to_channels(resample(want.waveform, 48000, 24000), 1))
