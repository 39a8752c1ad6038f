"""The frame loop's own rules, through the pipeline and the engine: a chunk that gives no audio is retried and then
named; a text too long for one prompt is spoken in pieces; the engine refuses what it would not act on."""

import logging
import threading
import time

import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.engine import Engine, SpeechRequest
from moss_npu.tts.loop import FrameLoop
from tests.tts.test_pipeline import NANO, REFERENCE, needs_fixtures

TWO_CHUNKS = "First part of it. Second part here."
SAMPLED = RunConfig(seed=5, max_new_frames=4, voice_clone_max_text_tokens=6)


@pytest.fixture(scope="module")
def tts():
    return MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")


def silence_first_chunk(monkeypatch, tries: int):
    """Make text chunk 0 stop before its first frame on its first ``tries`` runs (a budget of 0 frames)."""
    real, runs = FrameLoop._request, []

    def request(self, job, chunk, decoder):
        rows, params = real(self, job, chunk, decoder)
        if chunk == 0:
            runs.append(params.generator)
            if len(runs) <= tries:
                params = type(params)(params.sampling, params.nq, 0, params.generator)
        return rows, params

    monkeypatch.setattr(FrameLoop, "_request", request)
    return runs


def counting_threads(original, seen: list):
    """``original`` wrapped to note the torch thread count of its calling thread first."""
    def counted(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)
    return counted


@pytest.fixture
def one_thread_of_four_cores(monkeypatch):
    """The test's thread on one torch thread, on a machine the engine is told has four physical cores; the test's
    thread count comes back after."""
    from moss_npu.cpu import threads as threads_module

    monkeypatch.setattr(threads_module, "usable_physical_cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def held(original, reached: threading.Event, gate: threading.Event):
    """``original`` wrapped to say it was reached, then wait for ``gate`` before it runs."""
    def waiting(self, *args, **kwargs):
        reached.set()
        gate.wait(timeout=30)
        return original(self, *args, **kwargs)
    return waiting

@needs_fixtures
def test_a_silent_chunk_is_generated_again_with_the_next_seed(tts, monkeypatch):
    runs = silence_first_chunk(monkeypatch, tries=1)
    result = tts.synthesize(TWO_CHUNKS, prompt_audio=REFERENCE, settings=SAMPLED)
    assert len(result.text_chunks) == 2 and len(runs) == 2 and not result.warnings
    assert result.timestamps[0].end_s > result.timestamps[0].start_s
    with_next = tts.synthesize(TWO_CHUNKS, prompt_audio=REFERENCE, settings=RunConfig(
        seed=5, max_new_frames=4, voice_clone_max_text_tokens=6, host_rng=True))
    assert with_next.codes.shape[0] > 0


@needs_fixtures
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "greedy"])
def test_a_chunk_that_stays_silent_is_named(tts, monkeypatch, caplog, sampled):
    """No words vanish unsaid: a warning naming the chunk (logged: the CLI's ``warning:`` line), the result's
    warnings and its timestamp; a greedy run is not retried (it would stop again)."""
    runs = silence_first_chunk(monkeypatch, tries=2)
    settings = SAMPLED if sampled else RunConfig(do_sample=False, max_new_frames=4, voice_clone_max_text_tokens=6)
    with caplog.at_level(logging.WARNING, logger="moss_npu"):
        result = tts.synthesize(TWO_CHUNKS, prompt_audio=REFERENCE, settings=settings)
    assert len(runs) == (2 if sampled else 1)
    assert len(result.warnings) == 1 and "text chunk 1" in result.warnings[0] and "no audio" in result.warnings[0]
    assert [r.getMessage() for r in caplog.records if "no audio" in r.getMessage()] == list(result.warnings)
    assert result.timestamps[0].no_audio and result.timestamps[0].public()["no_audio"] is True
    assert not result.timestamps[1].no_audio and "no_audio" not in result.timestamps[1].public()
    assert result.codes.shape[0] == 4  # the second chunk's frames only
    monkeypatch.undo()
    silence_first_chunk(monkeypatch, tries=2)
    with Engine(tts, max_batch=1) as engine:
        stream = engine.submit(SpeechRequest(TWO_CHUNKS, prompt_audio=REFERENCE, settings=settings))
        list(stream)
    assert len(stream.warnings) == 1 and "text chunk 1" in stream.warnings[0]


@needs_fixtures
def test_a_text_too_long_for_the_engine_is_spoken_in_pieces(tts):
    """The server's decoder holds max_len rows: a longer prompt is split at sentence boundaries, not refused."""
    text = " ".join(f"This is sentence number {i} of a long input." for i in range(40))
    settings = RunConfig(do_sample=False, max_new_frames=3)
    with Engine(tts, max_batch=1, max_len=256) as engine:
        stream = engine.submit(SpeechRequest(text, settings=settings))
        chunks = list(stream)
    pieces = stream.prepared.plan.chunks
    assert len(pieces) > 1 and all(rows.shape[0] + 3 <= 256 for rows in stream.prepared.rows)
    assert {c.chunk_index for c in chunks} == set(range(len(pieces)))
    assert " ".join(pieces).count("This is sentence number") == 40  # every word of the text, once


@pytest.mark.parametrize("setting,value", [("host_rng", False), ("tts_max_batch_size", 2),
                                           ("voice_clone_max_memory_per_sample_gb", 2.0)])
@needs_fixtures
def test_the_engine_refuses_what_it_would_not_act_on(tts, setting, value):
    with Engine(tts, max_batch=1) as engine:
        with pytest.raises(InputError, match=f"^{setting}: "):
            engine.submit(SpeechRequest("Hello.", settings=RunConfig(**{setting: value})))


@needs_fixtures
def test_the_engine_decodes_in_float32_after_non_finite_logits(tts, monkeypatch):
    """The engine has the pipeline's stability fallback: a bf16 engine whose first frame is non-finite speaks
    on from a float32 copy (``tests/tts/test_pipeline.py`` has the pipeline's cases)."""
    from moss_npu.nano.checkpoint import load_model
    from tests.tts.test_pipeline import overflow_below_float32

    bf16 = MossTTSNano(load_model(NANO / "tts", device="cpu", dtype=torch.bfloat16), tts.tokenizer, tts.codec)
    with overflow_below_float32(bf16.model.audio_lm_heads[0]), Engine(bf16, max_batch=1) as engine:
        stream = engine.submit(SpeechRequest("Streamed.", settings=RunConfig(do_sample=False, max_new_frames=6)))
        wave = torch.cat([c.waveform for c in stream], dim=1)
    assert wave.shape[-1] == 6 * tts.codec.frame_size and bool(torch.isfinite(wave).all())
    assert engine.loop.fallback is None and bf16.model.dtype == torch.bfloat16


@needs_fixtures
def test_the_server_worker_hands_on_the_warning(tts, monkeypatch):
    """The worker's summary of a request carries its warnings (the server sends them as SSE events)."""
    from moss_npu.serve.worker import WorkerLoop

    class Channel(list):
        def send(self, *message):
            self.append(message)

    silence_first_chunk(monkeypatch, tries=2)
    channel = Channel()
    settings = RunConfig(do_sample=False, max_new_frames=4, voice_clone_max_text_tokens=6)
    with Engine(tts, max_batch=1) as engine:
        WorkerLoop(tts, engine, channel)._pump(1, engine.submit(SpeechRequest(TWO_CHUNKS, prompt_audio=REFERENCE,
                                                                              settings=settings)))
    done = [message for message in channel if message[0] == "done"]
    assert len(done) == 1 and len(done[0][2]["warnings"]) == 1 and "text chunk 1" in done[0][2]["warnings"][0]


@needs_fixtures
def test_the_engine_prefills_on_the_audio_threads_too_while_they_are_idle(tts, monkeypatch, one_thread_of_four_cores):
    """A prefill on the frame thread runs on the engine's threads doubled (up to the physical cores) while the audio
    thread has no event to run (it gets none until the prefill ends), on its own count while it has; the frame
    thread's count comes back."""
    from moss_npu.nano.decoder import FrameDecoder

    seen, gate, busy = [], threading.Event(), threading.Event()
    monkeypatch.setattr(FrameDecoder, "admit_many", counting_threads(FrameDecoder.admit_many, seen))
    monkeypatch.setattr(Engine, "_audio_frame", held(Engine._audio_frame, busy, gate))
    try:
        with Engine(tts, max_batch=2) as engine:
            assert engine._prefill_threads() == 2
            stream = engine.submit(SpeechRequest("Hello there.", settings=RunConfig(do_sample=False, max_new_frames=3)))
            assert busy.wait(timeout=30)
            assert engine._prefill_threads() == 1  # the audio thread is decoding
            gate.set()
            list(stream)
            engine._events.join()  # the stream ends inside the audio thread's last event, just before it is done
            assert seen == [2] and engine._prefill_threads() == 2
            engine._threads = 3
            assert engine._prefill_threads() == 4  # never more threads than physical cores
        assert torch.get_num_threads() == 1
    finally:
        gate.set()


@needs_fixtures
def test_the_engine_decodes_audio_on_the_frame_threads_too_while_they_are_idle(tts, monkeypatch,
                                                                              one_thread_of_four_cores):
    """A codec call of several streams on the audio thread runs on the engine's threads doubled (up to the physical
    cores) while the frame loop has no request, on its own count while it has one; a one-stream call on its own."""
    from moss_npu.codec.rows import CodecRows
    from moss_npu.nano.decoder import FrameDecoder

    seen, gate, stepping, codec_threads = [], threading.Event(), threading.Event(), Engine._codec_threads
    monkeypatch.setattr(CodecRows, "decode", counting_threads(CodecRows.decode, seen))
    monkeypatch.setattr(FrameDecoder, "step", held(FrameDecoder.step, stepping, gate))
    try:
        with Engine(tts, max_batch=2) as engine:
            assert engine._codec_threads(2) == 2 and engine._codec_threads(1) == 1  # no request
            stream = engine.submit(SpeechRequest("Hello there.", settings=RunConfig(do_sample=False, max_new_frames=3)))
            assert stepping.wait(timeout=30)
            assert engine._codec_threads(2) == 1  # a request is decoding
            monkeypatch.setattr(Engine, "_codec_threads", lambda self, streams: 3)
            gate.set()
            list(stream)
            engine._events.join()
            assert seen and set(seen) == {3}  # every codec call ran on the count asked for
            engine._threads = 3
            assert codec_threads(engine, 8) == 4  # idle again; never more threads than physical cores
    finally:
        gate.set()


def recording_pool_threads(original, pool, seen: list):
    """``original`` wrapped to note how many threads ``pool`` (``KernelThreads``) shares products over first."""
    def recorded(self, *args, **kwargs):
        seen.append(pool.used)
        return original(self, *args, **kwargs)
    return recorded


def until(condition, timeout: float = 30.0) -> bool:
    """Wait for ``condition()`` (another thread's next step), polling; return whether it came."""
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.001)
    return condition()


@needs_fixtures
def test_the_audio_thread_lends_its_cores_to_the_frames_only_while_it_is_idle(tts, monkeypatch,
                                                                             one_thread_of_four_cores):
    """The frames' kernel products borrow the audio thread's cores while it has nothing to decode, and the frame
    thread takes them back as it hands it work: no frame shares a core with a codec call."""
    from moss_npu.cpu.step import CpuStep

    pool = tts.weights.frame_step._kernels_used.threads
    calls, during, holding, gate, busy = [], [], threading.Event(), threading.Event(), threading.Event()
    audio_frame = Engine._audio_frame

    def held_when_asked(self, frame):
        if holding.is_set():
            busy.set()
            gate.wait(timeout=30)
        return audio_frame(self, frame)

    def local_audio(self, *args, **kwargs):  # from the second frame held on: the first frame's audio is decoding
        if holding.is_set() and not gate.is_set():
            calls.append(pool.used)
            if len(calls) > 1:
                assert busy.wait(timeout=30)
                during.append(pool.used)
        return real_local_audio(self, *args, **kwargs)

    real_local_audio = CpuStep.local_audio
    monkeypatch.setattr(Engine, "_audio_frame", held_when_asked)
    monkeypatch.setattr(CpuStep, "local_audio", local_audio)
    request = SpeechRequest("Hello there.", settings=RunConfig(do_sample=False, max_new_frames=4))
    try:
        with Engine(tts, max_batch=2) as engine:
            assert engine.decoder.frame_step is tts.weights.frame_step
            list(engine.submit(request))
            assert until(lambda: pool.lent == 1)  # idle: lent
            with engine.decoder.frame_step.threads(1):
                assert pool.used == 2  # the next frame's products run on both
            holding.set()
            stream = engine.submit(request)
            assert until(lambda: len(during) >= 2)
            assert pool.lent == 0 and set(during) == {1}  # the audio thread decodes: the frames keep to their own
            gate.set()
            list(stream)
            assert until(lambda: pool.lent == 1)
    finally:
        gate.set()
    assert pool.lent == 0  # the engine closed: the frame step, which the pipeline's weights hold, lends nothing


@needs_fixtures
def test_a_pipeline_lends_its_frames_the_spare_cores_and_takes_them_back_for_the_codec(tts, monkeypatch,
                                                                                      one_thread_of_four_cores):
    """Under the default thread setting (``spare_threads``, from_pretrained's ``num_threads=0``) a pipeline's frames
    run their products on the spare cores too, and its caller's work between events (the codec) on its own."""
    from moss_npu.cpu import threads as threads_module
    from moss_npu.cpu.step import CpuStep

    pool = tts.weights.frame_step._kernels_used.threads
    during = []
    monkeypatch.setattr(CpuStep, "local_audio", recording_pool_threads(CpuStep.local_audio, pool, during))
    settings = RunConfig(do_sample=False, max_new_frames=4)
    monkeypatch.setattr(tts, "spare_threads", 1)
    between = [pool.used for _ in tts.synthesize_stream("Hello there.", settings=settings)]
    assert set(during) == {2} and set(between) == {1} and pool.lent == 0
    monkeypatch.setattr(tts, "spare_threads", 0)
    during.clear()
    tts.synthesize("Hello there.", settings=settings)
    assert set(during) == {1}

    monkeypatch.setattr(threads_module, "usable_physical_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        chosen = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", num_threads=0)
        explicit = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", num_threads=1)
    finally:
        torch.set_num_threads(before)
    assert chosen.spare_threads == 1 and explicit.spare_threads == 0  # one core each: the policy's, the user's
