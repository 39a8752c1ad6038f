"""POST /v1/audio/speech over real HTTP: the official openai client for every format, SSE and bad bodies."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile

from tests.serve.conftest import API_KEY, FRAME, MODEL, assert_error, serve_module

serve_module("fastapi")
openai = serve_module("openai")

FRAMES = 6
GREEDY = {"max_new_frames": FRAMES, "greedy": True}
LOSSLESS = ("wav", "flac")
NUMBERS = "I paid $12.99 for 2 books in 2023"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def decoded(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").reshape(-1, 2), 48000
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples, rate


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_openai_client_create_every_format(client, fmt):
    audio = client.audio.speech.create(model=MODEL, voice="default", input="Hello there.", response_format=fmt,
                                       extra_body=GREEDY).read()
    samples, rate = decoded(audio, fmt)
    assert rate == 48000 and samples.shape[1] == 2
    if fmt == "pcm":
        assert len(audio) == FRAMES * FRAME * 2 * 2  # samples × channels × 2 bytes
    elif fmt in LOSSLESS:
        assert samples.shape[0] == FRAMES * FRAME
    else:  # lossy encoders pad the ends
        assert abs(samples.shape[0] - FRAMES * FRAME) <= 2 * FRAME
    assert np.abs(samples).max() > 0


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_openai_client_streaming_response_every_format(client, fmt):
    with client.audio.speech.with_streaming_response.create(model=MODEL, voice="default", input="Good morning.",
                                                            response_format=fmt, extra_body=GREEDY) as response:
        assert response.headers["x-sample-rate"] == "48000" and response.headers["x-channels"] == "2"
        pieces = list(response.iter_bytes())
    data = b"".join(pieces)
    samples, _ = decoded(data, fmt)
    if fmt in ("pcm", *LOSSLESS):
        assert samples.shape == (FRAMES * FRAME, 2)


def test_streamed_wav_has_a_streaming_header_and_whole_audio(server):
    with server.client() as http, http.stream("POST", "/v1/audio/speech", json={
            "model": MODEL, "input": "Streaming.", "response_format": "wav", "stream": True, **GREEDY}) as r:
        assert r.status_code == 200
        chunks = list(r.iter_bytes())
    data = b"".join(chunks)
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 48000 and samples.shape == (FRAMES * FRAME, 2)


def test_pcm_resampled_and_downmixed_on_the_server(client):
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input="Hello.", response_format="pcm",
            extra_body={**GREEDY, "sample_rate": 24000, "channels": 1}) as response:
        assert response.headers["x-sample-rate"] == "24000" and response.headers["x-channels"] == "1"
        data = response.read()
    assert len(data) == FRAMES * FRAME // 2 * 1 * 2


def test_sse_sends_deltas_then_done_with_usage(server):
    events = []
    with server.client() as http, http.stream("POST", "/v1/audio/speech", json={
            "model": MODEL, "input": "Events.", "stream_format": "sse", "response_format": "pcm", **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    kinds = [e["type"] for e in events]
    # Deltas, the text chunk's timestamp once its audio is complete, then done.
    assert kinds[-1] == "speech.audio.done" and kinds[-2] == "speech.audio.timestamp" and len(kinds) >= 3
    assert set(kinds[:-2]) == {"speech.audio.delta"}
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-2])
    assert len(audio) == FRAMES * FRAME * 2 * 2
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == FRAMES and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_greedy_is_repeatable_and_seeded_sampling_too(server):
    with server.client() as http:
        body = {"model": MODEL, "input": "Same again.", **GREEDY}
        first, second = (http.post("/v1/audio/speech", json=body) for _ in range(2))
        sampled = [http.post("/v1/audio/speech", json={"model": MODEL, "input": "Seeded.", "seed": 7,
                                                        "max_new_frames": FRAMES}) for _ in range(2)]
    assert first.headers["x-codes-sha256"] == second.headers["x-codes-sha256"]
    assert first.content == second.content
    assert sampled[0].headers["x-codes-sha256"] == sampled[1].headers["x-codes-sha256"]


def test_ref_audio_clones_a_voice_and_ref_text_continues(server, reference_bytes):
    encoded = base64.b64encode(reference_bytes).decode()
    with server.client() as http:
        clone = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Clone me.", "ref_audio": encoded,
                                                    **GREEDY})
        uri = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Clone me.",
                                                  "ref_audio": "data:audio/wav;base64," + encoded, **GREEDY})
        plain = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Clone me.", **GREEDY})
        cont = http.post("/v1/audio/speech", json={"model": MODEL, "input": "and then more.", "ref_audio": encoded,
                                                   "ref_text": "Some words.", **GREEDY})
    assert clone.status_code == uri.status_code == plain.status_code == cont.status_code == 200
    assert clone.headers["x-codes-sha256"] == uri.headers["x-codes-sha256"]
    assert clone.headers["x-codes-sha256"] != plain.headers["x-codes-sha256"]
    assert cont.headers["x-audio-frames"] == str(FRAMES)


@pytest.fixture(scope="module")
def reference_bytes():
    from moss_npu_verify import goldens

    return (goldens.fixtures_root() / "nano-tiny" / "goldens" / "reference.wav").read_bytes()


BAD_BODIES = [
    ({"model": MODEL}, 422, "input"),
    ({"model": MODEL, "input": "   "}, 400, "input"),
    ({"model": MODEL, "input": "x" * 201}, 413, "input"),
    ({"model": MODEL, "input": "hi", "voice": "nobody"}, 404, "voice"),
    ({"model": MODEL, "input": "hi", "voice": {"id": "../../etc/passwd"}}, 404, "voice"),
    ({"model": MODEL, "input": "hi", "response_format": "aac"}, 400, "response_format"),
    ({"model": MODEL, "input": "hi", "response_format": "flac", "stream": True}, 400, "response_format"),
    ({"model": MODEL, "input": "hi", "speed": 9.0}, 400, "speed"),
    ({"model": MODEL, "input": "hi", "speed": 0.2}, 400, "speed"),
    ({"model": MODEL, "input": "hi", "instructions": "whisper"}, 400, "instructions"),
    ({"model": MODEL, "input": "hi", "ref_audio": "not base64 at all!!"}, 400, "ref_audio"),
    ({"model": MODEL, "input": "hi", "ref_audio": base64.b64encode(b"plain text, no audio").decode()}, 400,
     "ref_audio"),
    ({"model": MODEL, "input": "hi", "ref_audio": "A" * 1_420_000}, 413, "ref_audio"),
    ({"model": MODEL, "input": "hi", "ref_text": "words"}, 400, "ref_text"),
    ({"model": MODEL, "input": "hi", "max_new_frames": 0}, 400, "max_new_frames"),
    ({"model": MODEL, "input": "hi", "sample_rate": 44100, "response_format": "opus"}, 400, "sample_rate"),
    ({"model": MODEL, "input": "hi", "channels": 3}, 400, "channels"),
    ({"model": MODEL, "input": "hi", "audio_top_p": 7.0}, 400, "audio_top_p"),
    ({"model": MODEL, "input": "hi", "channels": True}, 422, "channels"),  # strict types: true is no count
    ({"model": MODEL, "input": "hi", "max_new_frames": "3"}, 422, "max_new_frames"),
    ({"model": MODEL, "input": "hi", "volume": 11}, 422, "volume"),
    ({"model": MODEL, "input": 5}, 422, "input"),
    ({"model": "tts-1", "input": "hi"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES, ids=[f"{b[1]}-{b[2]}" for b in BAD_BODIES])
def test_bad_bodies_get_the_right_status_and_error_shape(server, body, status, param):
    with server.client() as http:
        assert_error(http.post("/v1/audio/speech", json=body), status, param)


def test_garbage_json_and_unknown_routes_keep_the_server_serving(server):
    with server.client() as http:
        assert_error(http.post("/v1/audio/speech", content=b"{not json",
                               headers={"content-type": "application/json"}), 400)
        assert_error(http.get("/v1/nothing-here"), 404)
        assert_error(http.put("/v1/audio/speech", json={}), 405)
        ok = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Still here.", **GREEDY})
    assert ok.status_code == 200


@pytest.mark.parametrize("fmt, sample_format, subtype", [
    ("wav", None, "PCM_16"), ("flac", None, "PCM_16"), ("wav", "s24", "PCM_24"), ("flac", "s24", "PCM_24"),
    ("wav", "f32", "FLOAT"),
])
def test_whole_files_are_16_bit_unless_a_sample_format_is_asked(server, fmt, sample_format, subtype):
    body = {"model": MODEL, "input": "Depth.", "response_format": fmt, **GREEDY}
    if sample_format:
        body["sample_format"] = sample_format
    with server.client() as http:
        r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    info = soundfile.info(io.BytesIO(r.content))
    assert info.subtype == subtype and info.frames == FRAMES * FRAME


@pytest.mark.parametrize("body", [
    {"response_format": "flac", "sample_format": "f32"},
    {"response_format": "pcm", "sample_format": "s24"},
    {"response_format": "wav", "stream": True, "sample_format": "f32"},
    {"response_format": "wav", "sample_format": "s8"},
])
def test_a_sample_format_the_answer_cannot_hold_is_refused(server, body):
    with server.client() as http:
        r = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Depth.", **GREEDY, **body})
    assert_error(r, 400, "sample_format")


def test_api_key_is_required_except_for_health(server):
    import httpx

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        assert_error(httpx.post(f"{server.url}/v1/audio/speech", json={"model": MODEL, "input": "hi"},
                                headers=headers), 401)
        assert_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model=MODEL, voice="default", input="hi")


def test_models_and_metrics(server):
    with server.client() as http:
        models = http.get("/v1/models").json()
        text = http.get("/metrics").text
    assert models["data"][0]["id"] == MODEL
    for name in ("moss_npu_active_slots", "moss_npu_queue_depth", "moss_npu_time_to_first_audio_seconds_bucket",
                 "moss_npu_real_time_factor_bucket", "moss_npu_frames_total", "moss_npu_requests_total"):
        assert name in text


def test_text_normalization_switch_reaches_the_model(server):
    """The official text preparation reads numbers and symbols out, so switching it off changes the prompt."""
    with server.client() as http:
        digests = {flag: http.post("/v1/audio/speech", json={"model": MODEL, "input": NUMBERS,
                                                             "text_normalization": flag, **GREEDY}
                                   ).headers["x-codes-sha256"] for flag in (True, False)}
        default = http.post("/v1/audio/speech", json={"model": MODEL, "input": NUMBERS, **GREEDY})
    assert digests[True] != digests[False]
    assert default.headers["x-codes-sha256"] == digests[True]  # on by default, as in the CLI
