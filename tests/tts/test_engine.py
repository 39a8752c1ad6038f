"""The engine: several requests decoded together, each the same as alone; cancel; bad requests fail alone."""

import functools
import threading
import time

import pytest
import torch

from moss_npu_verify import goldens
from moss_npu.errors import InputError, MossNpuError
from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.engine import Cancelled, Engine, SpeechRequest
from tests.optional import missing

NANO = goldens.fixtures_root() / "nano-tiny"
REFERENCE = NANO / "goldens" / "reference.wav"
SETTINGS = RunConfig(seed=7, max_new_frames=6, voice_clone_max_text_tokens=8)


@pytest.fixture(scope="module")
def tts():
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
    return MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")


def collect(stream):
    chunks = list(stream)
    return torch.cat([c.waveform for c in chunks], dim=1), chunks


REQUESTS = [
    SpeechRequest("Hello there, my friend.", settings=SETTINGS),
    SpeechRequest("A second voice clone request that splits into chunks.", prompt_audio=REFERENCE,
                  settings=RunConfig(seed=3, max_new_frames=5, voice_clone_max_text_tokens=8)),
    SpeechRequest("Short.", settings=RunConfig(do_sample=False, max_new_frames=4)),
    # continuation: the codec row is primed with the reference's codes before the first frame
    SpeechRequest("And so it goes on.", prompt_audio=REFERENCE, prompt_text="A recorded voice.",
                  settings=RunConfig(seed=4, max_new_frames=5)),
]


def test_requests_in_a_batch_equal_alone(tts):
    """Same codes and (batched codec decode vs each alone) the same audio up to float rounding."""
    with Engine(tts, max_batch=1) as engine:
        alone = [collect(engine.submit(r)) for r in REQUESTS]
    with Engine(tts, max_batch=4) as engine:
        streams = [engine.submit(r) for r in REQUESTS]
        together = [collect(s) for s in streams]
    for (wave_a, chunks_a), (wave_b, chunks_b) in zip(alone, together):
        assert wave_a.shape == wave_b.shape and torch.allclose(wave_a, wave_b, atol=1e-5)
        # How audio is cut into pieces follows wall-clock playback lead; which text chunks and pauses do not.
        assert [(c.chunk_index, c.is_pause) for c in chunks_a if c.is_pause] == \
            [(c.chunk_index, c.is_pause) for c in chunks_b if c.is_pause]
        assert chunks_a[-1].chunk_index == chunks_b[-1].chunk_index
    assert all(s.codes is not None and s.codes.shape[1] == tts.config.n_vq for s in streams)
    assert all(s.first_audio_s is not None and s.first_audio_s > 0 for s in streams)
    assert max(c.chunk_index for c in together[1][1]) >= 1  # the voice clone really ran several chunks


def test_batched_audio_equals_offline_decode(tts):
    """Each request's audio from the shared codec rows = the one-shot decode of its own codes (primed rows too)."""
    greedy = RunConfig(do_sample=False, max_new_frames=6)
    requests = [SpeechRequest("Hello there, my friend.", settings=greedy),
                SpeechRequest("Short.", settings=RunConfig(do_sample=False, max_new_frames=4)),
                SpeechRequest("And so it goes on.", prompt_audio=REFERENCE, prompt_text="A recorded voice.",
                              settings=greedy)]
    with Engine(tts, max_batch=4) as engine:
        streams = [engine.submit(r) for r in requests]
        waves = [collect(s)[0] for s in streams]
    for request, stream, wave in zip(requests, streams, waves):
        want = tts.synthesize(request.text, prompt_audio=request.prompt_audio, prompt_text=request.prompt_text,
                              settings=request.settings)
        assert torch.equal(stream.codes, want.codes)
        assert wave.shape == want.waveform.shape
        assert (wave - want.waveform).abs().max() <= 1e-5 * want.waveform.abs().max()


def test_stream_audio_matches_synthesize_stream(tts):
    """The engine's audio for one request = the pipeline's own streamed audio with the same host RNG seed."""
    settings = RunConfig(seed=5, host_rng=True, max_new_frames=5)
    with Engine(tts, max_batch=2) as engine:
        wave, _ = collect(engine.submit(SpeechRequest("Hello there, my friend.", settings=settings)))
    want = torch.cat([c.waveform for c in tts.synthesize_stream("Hello there, my friend.", settings=settings)], dim=1)
    assert wave.shape == want.shape and torch.allclose(wave, want, atol=1e-5)


def test_cancel_frees_the_slot(tts):
    long = RunConfig(do_sample=False, max_new_frames=200)
    with Engine(tts, max_batch=1) as engine:
        first = engine.submit(SpeechRequest("A long request that will be cancelled.", settings=long))
        second = engine.submit(SpeechRequest("Next in line.", settings=SETTINGS))
        next(first)  # decoding has started
        assert engine.active_slots == 1 and engine.queued == 1
        first.cancel()
        wave, _ = collect(second)  # runs only once the cancelled request left its slot
        with pytest.raises(Cancelled):
            list(first)
        assert wave.shape[1] > 0 and first.codes is None
        deadline = time.time() + 5
        while engine.active_slots and time.time() < deadline:
            time.sleep(0.01)
        assert engine.active_slots == 0 and engine.queued == 0


def test_a_bad_request_fails_alone(tts):
    with Engine(tts, max_batch=2) as engine:
        bad = engine.submit(SpeechRequest("   ", settings=SETTINGS))
        good = engine.submit(SpeechRequest("Hello.", settings=SETTINGS))
        too_long = engine.submit(SpeechRequest("Hello.", settings=RunConfig(max_new_frames=5000)))
        with pytest.raises(InputError, match="empty"):
            next(bad)
        with pytest.raises(InputError, match="max_len"):
            list(too_long)
        assert collect(good)[0].shape[1] > 0


def test_stored_voice_codes(tts):
    codes = tts.reference_codes(REFERENCE)
    with Engine(tts, max_batch=2) as engine:
        by_codes = collect(engine.submit(SpeechRequest("Hello.", prompt_codes=codes, settings=SETTINGS)))[0]
        by_audio = collect(engine.submit(SpeechRequest("Hello.", prompt_audio=REFERENCE, settings=SETTINGS)))[0]
        by_bytes = collect(engine.submit(SpeechRequest("Hello.", prompt_audio=REFERENCE.read_bytes(),
                                                       settings=SETTINGS)))[0]
        bad = engine.submit(SpeechRequest("Hello.", prompt_codes=torch.zeros(3, 2, dtype=torch.long),
                                          settings=SETTINGS))
        with pytest.raises(InputError, match="prompt codes"):
            next(bad)
    assert torch.equal(by_codes, by_audio) and torch.equal(by_codes, by_bytes)


def test_closed_engine_refuses_and_ends_streams(tts):
    engine = Engine(tts, max_batch=1)
    engine.close()
    with pytest.raises(MossNpuError, match="closed"):
        engine.submit(SpeechRequest("Hello.", settings=SETTINGS))


def test_a_frame_failing_at_a_release_fails_its_requests_and_the_engine_serves_on(tts, monkeypatch):
    """The deferred global step of a frame runs when a finished request's slot is released; if it fails there, the
    requests still decoding fail (like any failed frame) and the engine goes on serving (its thread died before,
    leaving every stream waiting forever)."""
    greedy = RunConfig(do_sample=False, max_new_frames=2)
    with Engine(tts, max_batch=2) as engine:
        decoder, fired = engine.decoder, []
        release, global_step = decoder.release, decoder._global_step

        def failing_step(*args):
            if releasing and not fired:
                fired.append(True)
                raise RuntimeError("injected: out of memory")
            return global_step(*args)

        def tracked_release(slot):
            releasing.append(slot)
            try:
                release(slot)
            finally:
                releasing.pop()

        releasing: list = []
        monkeypatch.setattr(decoder, "_global_step", failing_step)
        monkeypatch.setattr(decoder, "release", tracked_release)
        # Prepared here, so that holding the engine's lock keeps both queued until its first frame (a request the
        # engine prepares itself is queued later, from its preparation thread, and may start a frame alone).
        prepare = functools.partial(tts.preparer.prepare, max_rows=decoder.state.max_len)
        requests = [prepare(SpeechRequest("Hi.", settings=greedy)),
                    prepare(SpeechRequest("A longer request.", settings=RunConfig(do_sample=False,
                                                                                  max_new_frames=12)))]
        with engine._cond:  # both requests are queued before the engine's first frame
            short, long = (engine.submit(request) for request in requests)
        outcomes: dict = {}

        def drain(name, stream):
            try:
                outcomes[name] = len(list(stream))
            except MossNpuError as exc:
                outcomes[name] = exc

        threads = [threading.Thread(target=drain, args=item, daemon=True) for item in (("short", short),
                                                                                       ("long", long))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert fired and len(outcomes) == 2, outcomes
        assert sum(isinstance(o, MossNpuError) and "injected" in str(o) for o in outcomes.values()) == 1
        assert collect(engine.submit(SpeechRequest("After.", settings=greedy)))[0].shape[1] > 0


def test_a_slow_preparation_does_not_stall_other_streams(tts, monkeypatch):
    """Preparation (text normalization, reference encoding, prompt rows) runs beside the frame thread: while one
    request is held in preparation, a running stream's chunks keep coming (the frame thread once prepared each
    request itself, and every stream stopped for as long). The held preparation is released after 10 s at the
    latest, so a stalled engine fails the test instead of hanging it, whatever the machine's speed."""
    real_prepare = tts.preparer.prepare
    held, release = threading.Event(), threading.Event()

    def slow(request, **limits):
        if request.text.startswith("Slow"):
            held.set()
            release.wait(10)
        return real_prepare(request, **limits)

    monkeypatch.setattr(tts.preparer, "prepare", slow)
    with Engine(tts, max_batch=2) as engine:
        running = engine.submit(SpeechRequest("A long running stream. " * 4,
                                              settings=RunConfig(do_sample=False, max_new_frames=375)))
        chunks = iter(running)
        next(chunks)
        slow_stream = engine.submit(SpeechRequest("Slow to prepare.", settings=RunConfig(do_sample=False,
                                                                                         max_new_frames=2)))
        assert held.wait(10)
        timer = threading.Timer(10, release.set)
        timer.start()
        try:
            during = [not release.is_set() for _ in range(2) if next(chunks, None) is not None]
        finally:
            release.set()
            timer.cancel()
        running.cancel()
        assert collect(slow_stream)[0].shape[1] > 0
    assert during == [True, True], "the running stream waited for another request's preparation"


def test_requests_in_preparation_count_as_queued_and_can_be_cancelled(tts, monkeypatch):
    gate = threading.Event()
    real_prepare = tts.preparer.prepare
    monkeypatch.setattr(tts.preparer, "prepare", lambda request, **limits: (gate.wait(10), real_prepare(request, **limits))[1])
    with Engine(tts, max_batch=1) as engine:
        first = engine.submit(SpeechRequest("One.", settings=RunConfig(do_sample=False, max_new_frames=2)))
        second = engine.submit(SpeechRequest("Two.", settings=RunConfig(do_sample=False, max_new_frames=2)))
        assert engine.queued == 2 and engine.active_slots == 0
        second.cancel()
        gate.set()
        assert collect(first)[0].shape[1] == 2 * 3840
        with pytest.raises(Cancelled):
            collect(second)
        assert engine.queued == 0


def test_frames_go_on_while_the_codec_decodes(tts, monkeypatch):
    """The codec runs on its own thread: while one codec call is held, the frame thread keeps producing frames
    (with the codec on the frame thread, no frame came until the call returned), and the held request's
    audio still comes complete and in order afterwards."""
    from moss_npu.codec.rows import CodecRows

    release, held, frames_while_held = threading.Event(), threading.Event(), []
    real_decode = CodecRows.decode

    def slow_decode(self, due):
        if not held.is_set():
            held.set()
            release.wait(10)
        return real_decode(self, due)

    monkeypatch.setattr(CodecRows, "decode", slow_decode)
    # 375 frames: the first codec call comes after the stream's first few, so frames are left to run while it is
    # held however far the frame thread got before it (12 frames could all be done by then on a loaded machine).
    settings = RunConfig(do_sample=False, max_new_frames=375)
    with Engine(tts, max_batch=1) as engine:
        stream = engine.submit(SpeechRequest("A long one.", settings=settings))
        assert held.wait(30)
        before = engine.decoder.frame_index
        deadline = time.monotonic() + 10
        while engine.decoder.frame_index == before and time.monotonic() < deadline:
            time.sleep(0.01)
        frames_while_held.append(engine.decoder.frame_index - before)
        release.set()
        wave, _ = collect(stream)
    with Engine(tts, max_batch=1) as engine:
        alone, _ = collect(engine.submit(SpeechRequest("A long one.", settings=settings)))
    assert frames_while_held[0] > 0
    assert wave.shape == alone.shape and torch.allclose(wave, alone, atol=1e-5)


def test_a_codec_failure_fails_its_request_alone(tts, monkeypatch):
    """A codec call that raises fails the requests it decoded (their streams raise the error); the engine frees
    their slots and serves the next request."""
    from moss_npu.codec.rows import CodecRows

    real_decode, failures = CodecRows.decode, []

    def failing_once(self, due):
        if not failures:
            failures.append(True)
            raise RuntimeError("codec broke")
        return real_decode(self, due)

    monkeypatch.setattr(CodecRows, "decode", failing_once)
    settings = RunConfig(do_sample=False, max_new_frames=8)
    with Engine(tts, max_batch=1) as engine:
        with pytest.raises(RuntimeError, match="codec broke"):
            collect(engine.submit(SpeechRequest("Hello there, my friend.", settings=settings)))
        wave, _ = collect(engine.submit(SpeechRequest("Short.", settings=settings)))
        assert wave.shape[1] > 0
        deadline = time.monotonic() + 10
        while engine.active_slots and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.active_slots == 0 and engine.decoder.free_slots == 1
