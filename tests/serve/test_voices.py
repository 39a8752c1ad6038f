"""Voices: upload / list / get / use / delete over HTTP, bad uploads, and the store's file handling."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import soundfile
import torch

from moss_npu_verify import goldens
from moss_npu.serve.errors import ApiError
from moss_npu.serve.voices import VoiceStore
from tests.serve.conftest import MODEL, assert_error, serve_module

serve_module("fastapi")

GREEDY = {"max_new_frames": 4, "greedy": True}


def recording(seconds: float = 1.0, rate: int = 22050, channels: int = 1, fmt: str = "FLAC") -> bytes:
    """A short tone in another rate, channel count and container than the model's (it resamples them)."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype("float32")
    out = io.BytesIO()
    soundfile.write(out, np.stack([tone] * channels, axis=1), rate, format=fmt)
    return out.getvalue()


def upload(http, name: str, data: bytes, transcript=None):
    fields = {"name": name} if transcript is None else {"name": name, "transcript": transcript}
    return http.post("/v1/audio/voices", data=fields, files={"audio": ("voice.bin", data)})


def test_upload_list_use_delete(server):
    with server.client() as http:
        made = upload(http, "narrator", recording())
        assert made.status_code == 200, made.text
        voice = made.json()
        assert voice["name"] == "narrator" and voice["id"].startswith("voice_") and voice["frames"] > 0
        assert voice["id"] in [v["id"] for v in http.get("/v1/audio/voices").json()["data"]]
        assert http.get(f"/v1/audio/voices/{voice['id']}").json()["name"] == "narrator"
        by_name = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "voice": "narrator", **GREEDY})
        by_id = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "voice": {"id": voice["id"]},
                                                    **GREEDY})
        plain = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", **GREEDY})
        assert by_name.status_code == by_id.status_code == 200
        assert by_name.headers["x-codes-sha256"] == by_id.headers["x-codes-sha256"]
        assert by_name.headers["x-codes-sha256"] != plain.headers["x-codes-sha256"]
        assert_error(upload(http, "narrator", recording()), 409, "name")
        gone = http.delete(f"/v1/audio/voices/{voice['id']}")
        assert gone.json() == {"id": voice["id"], "name": "narrator", "object": "voice", "deleted": True}
        assert_error(http.delete(f"/v1/audio/voices/{voice['id']}"), 404)
        assert_error(http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "voice": "narrator"}), 404,
                     "voice")


def test_voice_with_transcript_speaks_in_continuation(server):
    reference = goldens.fixtures_root() / "nano-tiny" / "goldens" / "reference.wav"
    with server.client() as http:
        voice = upload(http, "with-words", reference.read_bytes(), transcript="Some words.").json()
        assert voice["transcript"] == "Some words."
        spoken = http.post("/v1/audio/speech", json={"model": MODEL, "input": "More words.", "voice": "with-words",
                                                     **GREEDY})
        http.delete(f"/v1/audio/voices/{voice['id']}")
    assert spoken.status_code == 200 and spoken.headers["x-audio-frames"] == "4"


@pytest.mark.parametrize("case", ["not-audio", "too-long", "too-big", "no-name", "no-file", "reserved-name",
                                  "traversal-id"])
def test_bad_uploads(server, case):
    with server.client() as http:
        if case == "not-audio":
            assert_error(upload(http, "x", b"hello, I am text"), 400, "audio")
        elif case == "too-long":
            assert_error(upload(http, "x", recording(seconds=25, rate=8000)), 413, "audio")
        elif case == "too-big":
            assert_error(upload(http, "x", b"\0" * (2**20 + 10)), 413, "audio")
        elif case == "no-name":
            assert_error(http.post("/v1/audio/voices", files={"audio": ("a.flac", recording())}), 422, "name")
        elif case == "no-file":
            assert_error(http.post("/v1/audio/voices", data={"name": "x"}), 422, "audio")
        elif case == "reserved-name":
            assert_error(upload(http, "default", recording()), 400, "name")
        else:
            assert_error(http.delete("/v1/audio/voices/..%2F..%2Fetc%2Fpasswd"), 404)
            assert_error(http.get("/v1/audio/voices/voice_../x"), 404)


def test_store_is_atomic_and_refuses_unsafe_ids(tmp_path):
    store = VoiceStore(tmp_path)
    voice = store.add("a", torch.arange(32).reshape(2, 16), 1.5, None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == [f"{voice.id}.safetensors"] and names[0].startswith(".name-")  # no temp file left
    found, codes = store.find("a")
    assert found == voice and torch.equal(codes, torch.arange(32).reshape(2, 16))
    (tmp_path / "voice_0123456789abcdef.safetensors").write_bytes(b"damaged")
    assert store.list() == [voice]  # a damaged file does not break the listing
    for bad in ("../a", "voice_/../../x", "/etc/passwd", "voice_0123"):
        with pytest.raises(ApiError) as info:
            store.delete(bad)
        assert info.value.status == 404
    assert store.delete(voice.id) == voice and store.list() == []


def test_two_stores_on_one_folder_never_store_one_name_twice(tmp_path):
    """Eight adds of one name at once, through two stores sharing the folder (two servers): one voice, seven 409."""
    stores = [VoiceStore(tmp_path), VoiceStore(tmp_path)]
    barrier = threading.Barrier(8)
    outcomes: list[object] = []

    def add(store: VoiceStore) -> None:
        barrier.wait()
        try:
            outcomes.append(store.add("same", torch.zeros(3, 16, dtype=torch.long), 0.24, None).id)
        except ApiError as exc:
            outcomes.append(exc.status)

    threads = [threading.Thread(target=add, args=(stores[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(o for o in outcomes if o == 409) == [409] * 7
    assert [v.name for v in stores[0].list()] == ["same"] and stores[1].list() == stores[0].list()


def test_lookups_read_no_file_and_see_the_other_store(tmp_path, monkeypatch):
    """The index answers lookups; a voice added or deleted through another store is seen at the next call."""
    import moss_npu.serve.voices as voices

    mine, theirs = VoiceStore(tmp_path), VoiceStore(tmp_path)
    for i in range(20):
        mine.add(f"v{i}", torch.zeros(2, 16, dtype=torch.long), 0.16, None)
    mine.find("v3")  # its codes are read once, on first use
    opened = []
    real_open = voices.safe_open
    monkeypatch.setattr(voices, "safe_open", lambda *a, **k: (opened.append(a[0]), real_open(*a, **k))[1])
    for _ in range(50):
        assert mine.find("v3")[0].name == "v3" and len(mine.list()) == 20
    assert opened == []
    added = theirs.add("new", torch.zeros(2, 16, dtype=torch.long), 0.16, None)
    assert mine.find("new")[0] == added
    theirs.delete(added.id)
    with pytest.raises(ApiError) as info:
        mine.find("new")
    assert info.value.status == 404
