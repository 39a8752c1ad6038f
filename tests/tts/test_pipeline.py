"""The pipeline's own behaviour beyond the goldens: reference cache, chunk batching, streaming cost, settings."""

import contextlib
import dataclasses
from collections import OrderedDict

import pytest
import soundfile as sf
import torch

from moss_npu_verify import goldens
from moss_npu.errors import ConfigError, InputError, NumericalError
from moss_npu.nano.checkpoint import load_model
from moss_npu.tts import LoadConfig, MossTTSNano, RunConfig
from moss_npu.tts.settings import load_preset, merge
from tests.optional import missing, needs

NANO = goldens.fixtures_root() / "nano-tiny"
REFERENCE = NANO / "goldens" / "reference.wav"
needs_fixtures = needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
GREEDY = dict(do_sample=False, audio_repetition_penalty=1.0)


@pytest.fixture(scope="module")
def tts():
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
    return MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")


def count_calls(monkeypatch, obj, name):
    calls = []
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


@needs_fixtures
def test_reference_is_encoded_once_per_content(tts, monkeypatch, tmp_path):
    """A path, another file with the same bytes, and the bytes themselves share one encode; a waveform pair is
    encoded once more (another kind of content) and then cached too; every form gives the same codes."""
    monkeypatch.setattr(tts.preparer, "_references", OrderedDict())  # earlier tests may have cached this reference
    calls = count_calls(monkeypatch, tts.codec, "encode")
    settings = RunConfig(**GREEDY, max_new_frames=2)
    tts.synthesize("One.", prompt_audio=REFERENCE, settings=settings)
    copy = tmp_path / "same_voice.flac"
    copy.write_bytes(REFERENCE.read_bytes())  # another name, same content: still cached
    tts.synthesize("Two.", prompt_audio=copy, settings=settings)
    tts.synthesize("Three.", prompt_audio=REFERENCE.read_bytes(), settings=settings)
    assert len(calls) == 1
    data, rate = sf.read(str(REFERENCE), dtype="float32", always_2d=True)
    pair = (torch.from_numpy(data.T.copy()), rate)
    from_pair = tts.reference_codes(pair)
    assert tts.reference_codes((data.T.copy(), rate)) is from_pair  # equal content, another array: cached
    assert len(calls) == 2
    assert torch.equal(from_pair, tts.reference_codes(REFERENCE))
    mono = (torch.from_numpy(data[:, 0].copy()), rate)  # (samples,) is one channel
    assert torch.equal(tts.reference_codes(mono), from_pair)


@pytest.mark.parametrize("source,pattern", [
    (123, "int 123 is not a recording"),
    (b"not audio at all", "<16 bytes>: cannot decode"),
    ((torch.zeros(2, 10, dtype=torch.long), 48000), "must be a float tensor"),
    ((torch.zeros(2, 2, 10), 48000), r"waveform \(2, 2, 10\) must be"),
    ((torch.zeros(2, 10), 0), "sample_rate 0 must be a positive int"),
    ((torch.zeros(2, 10), 44.1), "sample_rate 44.1 must be a positive int"),
])
def test_bad_prompt_audio_is_one_clear_error(source, pattern):
    from moss_npu.audio import load_reference_audio
    from moss_npu.errors import AudioError

    with pytest.raises(AudioError, match=pattern) as info:
        load_reference_audio(source)
    assert "\n" not in str(info.value)


@needs_fixtures
def test_batched_chunks_equal_sequential_chunks(tts):
    """Left-padded batches (what NPU/CUDA do from free memory) give the same codes as one chunk at a time."""
    text = "First part of it. Second part here. The third part. And the fourth one."
    one = tts.synthesize(text, prompt_audio=REFERENCE,
                         settings=RunConfig(**GREEDY, max_new_frames=4, voice_clone_max_text_tokens=6))
    many = tts.synthesize(text, prompt_audio=REFERENCE,
                          settings=RunConfig(**GREEDY, max_new_frames=4, voice_clone_max_text_tokens=6,
                                             tts_max_batch_size=3))
    assert len(one.text_chunks) >= 3 and one.batch_size == 1 and many.batch_size == 3
    assert torch.equal(one.codes, many.codes)
    assert one.waveform.shape == many.waveform.shape


@needs_fixtures
def test_streaming_decodes_each_frame_once(tts, monkeypatch):
    """O(N) codec work: N generated frames cost N decoder frames in total, however the schedule slices them."""
    decoded = []  # frames per codec call (a stream may reuse an earlier stream's state: count the calls)
    original = tts.codec.decode_step

    def spy(codes, *args, **kwargs):
        decoded.append(codes.shape[2])
        return original(codes, *args, **kwargs)

    monkeypatch.setattr(tts.codec, "decode_step", spy)
    frames = 20
    chunks = list(tts.synthesize_stream("Count the frames.", settings=RunConfig(**GREEDY, max_new_frames=frames)))
    audio = sum(c.waveform.shape[-1] for c in chunks)
    assert audio == frames * tts.codec.frame_size
    assert sum(decoded) == frames
    assert len(chunks) > 1


def test_presets_reject_unknown_keys(tmp_path):
    preset = tmp_path / "bad.yaml"
    preset.write_text("device: cpu\ntemprature: 0.5\n")
    with pytest.raises(ConfigError, match="unknown keys temprature"):
        load_preset(preset)


def test_presets_are_valid_on_their_own(tmp_path):
    """A value a flag overrides still has to be valid, and a key given twice would leave one value unused."""
    preset = tmp_path / "p.yaml"
    preset.write_text("max_new_frames: 1000000000000\n")
    with pytest.raises(ConfigError, match="p.yaml.*1000000000000"):
        load_preset(preset)
    preset.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match="seed' is given twice"):
        load_preset(preset)


def test_precedence_default_preset_flag(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_new_frames: 100\naudio_top_k: 10\nstream_budgets: [2, 4, 8, 12]\n")
    settings = merge(load_preset(preset), {"max_new_frames": 50, "audio_top_k": None}).run
    assert settings.max_new_frames == 50  # flag beats preset
    assert settings.audio_top_k == 10  # an unset flag leaves the preset value
    assert settings.text_top_k == 50  # default where neither sets it
    assert settings.schedule().budgets == (2, 4, 8, 12)


@pytest.mark.parametrize("preset", ["cpu", "cuda", "npu"])
def test_shipped_presets_load(preset):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{preset}.yaml"
    load, run = merge(load_preset(path))
    assert load.device.startswith(preset) and isinstance(run, RunConfig)


def test_load_time_settings_are_refused_per_call():
    """A per-call device/dtype/attention/threads would be silently ignored by a loaded pipeline: refused, with the fix."""
    for name, value in (("device", "npu"), ("dtype", "bfloat16"), ("attn_implementation", "eager"),
                        ("num_threads", 2), ("decoder", "reference"), ("graph", "on"), ("compile", "off")):
        with pytest.raises(ConfigError, match=f"^{name}: set when the pipeline loads.*from_pretrained"):
            RunConfig(**{name: value})
    with pytest.raises(ConfigError, match="device: set when the pipeline loads"):
        dataclasses.replace(RunConfig(), device="cpu")
    with pytest.raises(TypeError):
        RunConfig(temprature=0.5)  # any other unknown name stays a plain TypeError


@needs_fixtures
def test_how_the_decoder_computes_is_the_pipelines(tts):
    """decoder, graph and compile are fixed at load; another way is another pipeline over the same model, and
    the reference decoder (the oracle) gives the frame decoder's codes, whole and streamed."""
    settings = RunConfig(**GREEDY, max_new_frames=4)
    oracle = tts.computing(decoder="reference")
    assert oracle is not tts and oracle.model is tts.model and tts.computing() is tts
    assert torch.equal(oracle.synthesize("Same codes.", settings=settings).codes,
                       tts.synthesize("Same codes.", settings=settings).codes)
    streamed = [c.waveform for c in oracle.synthesize_stream("Same codes.", settings=settings)]
    assert sum(w.shape[-1] for w in streamed) == 4 * tts.codec.frame_size
    with pytest.raises(InputError, match="--graph sideways: unknown"):
        tts.computing(graph="sideways")
    from moss_npu.tts.engine import Engine

    with pytest.raises(InputError, match="decoder=reference"):
        Engine(oracle)


def test_merge_splits_load_and_run_settings(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("device: cpu\ndtype: bfloat16\nmax_new_frames: 100\n")
    load, run = merge(load_preset(preset), {"num_threads": 3, "seed": 5, "dtype": None})
    assert load == LoadConfig(device="cpu", dtype="bfloat16", num_threads=3)
    assert (run.max_new_frames, run.seed) == (100, 5)
    with pytest.raises(InputError, match="--num-threads -1"):
        merge(None, {"num_threads": -1})
    with pytest.raises(InputError, match="--quantize int4: unknown"):
        merge(None, {"quantize": "int4"})


@needs_fixtures
def test_int8_pipeline_quantizes_and_decodes_with_the_int8_step():
    from moss_npu.cpu.quantize import int8_kernel_available

    if not int8_kernel_available():
        missing("torch has no _weight_int8pack_mm")
    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", quantize="int8")
    result = tts.synthesize("Hello.", settings=RunConfig(do_sample=False, max_new_frames=4))
    assert tts.model.quantization == "int8" and tts._decoder.frame_step.int8
    assert result.codes.shape[0] > 0 and bool(torch.isfinite(result.waveform).all())
    with pytest.raises(InputError, match="--quantize int8 runs on the CPU in float32"):
        MossTTSNano.from_pretrained("/nonexistent/model", "/nonexistent/codec", device="cpu", dtype="bfloat16",
                                    quantize="int8")  # refused before any folder is read


@needs_fixtures
def test_synthesize_refuses_settings_that_are_not_a_run_config(tts):
    with pytest.raises(ConfigError, match="a LoadConfig is not a RunConfig"):
        tts.synthesize("Hi.", settings=LoadConfig(device="cpu"))
    with pytest.raises(ConfigError, match="a dict is not a RunConfig"):
        next(tts.synthesize_stream("Hi.", settings={"max_new_frames": 2}))


@needs_fixtures
def test_from_pretrained_applies_its_thread_count():
    """A count is the load's (the server's workers hand theirs here); 0 is the default policy; None leaves it."""
    from moss_npu.cpu.threads import default_threads

    before = torch.get_num_threads()
    try:
        MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", num_threads=1)
        assert torch.get_num_threads() == 1
        MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")
        assert torch.get_num_threads() == 1
        MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", num_threads=0)
        assert torch.get_num_threads() == default_threads()
    finally:
        torch.set_num_threads(before)


def test_bad_settings():
    with pytest.raises(InputError, match="--mode"):
        RunConfig(mode="sing")
    with pytest.raises(InputError, match="--audio-top-p 0.0"):
        RunConfig(audio_top_p=0.0)
    with pytest.raises(ConfigError, match="budgets"):
        RunConfig(stream_budgets=(1, 2))


@needs_fixtures
def test_settings_seed_makes_sampled_runs_repeatable_without_global_state(tts):
    """RunConfig.seed seeds a generator of the pipeline's own (as torch.manual_seed(seed) would draw)."""
    settings = RunConfig(max_new_frames=4, seed=1)
    torch.manual_seed(123)
    a = tts.synthesize("Seeded.", settings=settings)
    torch.manual_seed(456)
    b = tts.synthesize("Seeded.", settings=settings)
    assert torch.equal(a.codes, b.codes)
    torch.manual_seed(1)
    c = tts.synthesize("Seeded.", settings=RunConfig(max_new_frames=4))
    assert torch.equal(a.codes, c.codes)  # same draws as the official global seeding


@pytest.fixture(scope="module")
def bf16_tts():
    """A pipeline whose LM computes in bf16, as on an accelerator (on the CPU ``from_pretrained`` gives bf16
    weights with float32 arithmetic instead), for the stability fallback that exists for it."""
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")
    return MossTTSNano(load_model(NANO / "tts", device="cpu", dtype=torch.bfloat16), tts.tokenizer, tts.codec)


@needs_fixtures
def test_cpu_bfloat16_is_bf16_weights_with_float32_arithmetic():
    """On the CPU ``dtype="bfloat16"`` rounds every LM weight to bf16 and keeps float32 arithmetic; it decodes
    like the float32 pipeline on the rounded weights (the same codes, greedy)."""
    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", dtype="bfloat16")
    lm = tts.model
    assert lm.dtype == torch.float32 and lm.weight_dtype == "bfloat16"
    assert all(torch.equal(p, p.bfloat16().float()) for p in lm.parameters())
    fp32 = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")
    assert not all(torch.equal(p, p.bfloat16().float()) for p in fp32.model.parameters())
    with torch.no_grad():
        for mine, theirs in zip(fp32.model.parameters(), lm.parameters()):
            mine.copy_(theirs)
    settings = RunConfig(**GREEDY, max_new_frames=5)
    assert torch.equal(tts.synthesize("Rounded.", settings=settings).codes,
                       fp32.synthesize("Rounded.", settings=settings).codes)


@contextlib.contextmanager
def overflow_below_float32(module, after_calls=0):
    """Make ``module`` output NaN when it computes in less than float32 (after ``after_calls`` clean calls), as an
    overflow in bf16/fp16 would; the hook travels with a copy of the model, where float32 computes cleanly."""
    calls = []

    def hook(mod, args, output):
        calls.append(output.dtype)
        if output.dtype != torch.float32 and len(calls) > after_calls:
            return output * float("nan")
        return None

    handle = module.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


SAMPLED_FALLBACK = dict(max_new_frames=4, seed=3)  # sampled decoding: the official runtime defaults


@needs_fixtures
@pytest.mark.parametrize("where", ["text", "audio"])
def test_fallback_in_sampled_decoding_leaves_the_model_as_loaded(bf16_tts, where, caplog):
    """Non-finite logits never reach torch.multinomial: the batch is generated again with a float32 copy, and
    the loaded bf16 model stays bf16 for later calls (which fall back again)."""
    lm = bf16_tts.model
    module = lm.local_transformer.ln_f if where == "text" else lm.audio_lm_heads[2]
    weights = {k: v.clone() for k, v in lm.state_dict().items()}
    with overflow_below_float32(module) as calls:
        for _ in range(2):
            result = bf16_tts.synthesize("Fallback.", settings=RunConfig(**SAMPLED_FALLBACK))
            assert result.codes.shape[0] > 0 and bool(torch.isfinite(result.waveform).all())
            assert lm.dtype == torch.bfloat16
    assert torch.bfloat16 in calls  # the float32 copy decodes through the CPU step, which calls no module
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in weights.items())
    assert sum("float32 copy" in r.getMessage() for r in caplog.records) == 2


@needs_fixtures
def test_fallback_in_a_stream_before_any_audio(bf16_tts):
    """A stream whose first frame is non-finite in bf16 gives the float32 copy's audio, nothing non-finite."""
    with overflow_below_float32(bf16_tts.model.audio_lm_heads[0]):
        chunks = list(bf16_tts.synthesize_stream("Streamed.", settings=RunConfig(**GREEDY, max_new_frames=6)))
    wave = torch.cat([c.waveform for c in chunks], dim=1)
    assert wave.shape[-1] == 6 * bf16_tts.codec.frame_size and bool(torch.isfinite(wave).all())
    assert bf16_tts.model.dtype == torch.bfloat16


@needs_fixtures
def test_fallback_in_a_stream_continues_after_the_audio_already_played(bf16_tts):
    """Frames 0-3 are fine in bf16, frame 4 is not: the audio already yielded stays as it was and the float32
    copy continues from there, so the stream keeps its full length and every sample is finite."""
    settings = RunConfig(**GREEDY, max_new_frames=8)
    clean = torch.cat([c.waveform for c in bf16_tts.synthesize_stream("Streamed on.", settings=settings)], dim=1)
    frame = bf16_tts.codec.frame_size
    with overflow_below_float32(bf16_tts.model.audio_lm_heads[1], after_calls=4):
        stream = bf16_tts.synthesize_stream("Streamed on.", settings=settings)
        first = next(stream)  # decoded before the bad frame exists
        rest = list(stream)
    wave = torch.cat([first.waveform] + [c.waveform for c in rest], dim=1)
    assert first.waveform.shape[-1] >= frame and torch.equal(first.waveform, clean[:, :first.waveform.shape[-1]])
    assert wave.shape == clean.shape and bool(torch.isfinite(wave).all())
    assert not torch.equal(wave, clean)  # the tail really comes from the float32 continuation
    assert bf16_tts.model.dtype == torch.bfloat16


@needs_fixtures
def test_non_finite_in_float32_says_precision_is_not_the_cause(bf16_tts):
    """A NaN weight stays NaN in float32: the fallback fails too and says what to do instead (sampled and streamed)."""
    lm = bf16_tts.model
    saved = lm.audio_lm_heads[3].weight[5, 0].clone()
    with torch.no_grad():
        lm.audio_lm_heads[3].weight[5, 0] = float("nan")
    try:
        with pytest.raises(NumericalError, match="in float32, so precision is not the cause.*download"):
            bf16_tts.synthesize("Broken.", settings=RunConfig(**SAMPLED_FALLBACK))
        with pytest.raises(NumericalError, match="in float32, so precision is not the cause"):
            list(bf16_tts.synthesize_stream("Broken.", settings=RunConfig(**SAMPLED_FALLBACK)))
        with pytest.raises(NumericalError, match=r"bfloat16\); run the model in float32 \(--dtype float32\)"):
            bf16_tts.synthesize("Broken.", settings=RunConfig(**SAMPLED_FALLBACK, stability_fallback=False))
    finally:
        with torch.no_grad():
            lm.audio_lm_heads[3].weight[5, 0] = saved
    assert lm.dtype == torch.bfloat16


@needs_fixtures
def test_a_second_call_while_a_stream_is_open_is_one_clear_error(tts):
    settings = RunConfig(**GREEDY, max_new_frames=6)
    stream = tts.synthesize_stream("An open stream.", settings=settings)
    next(stream)
    with pytest.raises(InputError, match="already generating"):
        tts.synthesize("Another call.", settings=settings)
    stream.close()
    assert tts.synthesize("Another call.", settings=settings).codes.shape[0] > 0


@needs_fixtures
def test_streams_reuse_the_codec_state_only_once_it_is_free(tts, monkeypatch):
    """A stream reuses the last finished stream's codec state (reset: the same audio as a fresh one, up to the
    float rounding of how the codec calls sliced the frames, which depends on timing); a stream started while
    another is open gets a state of its own, so the refused one cannot disturb the open one."""
    settings = RunConfig(**GREEDY, max_new_frames=6)
    audio = lambda stream: torch.cat([chunk.waveform for chunk in stream], dim=-1)  # noqa: E731
    same = lambda a, b: a.shape == b.shape and torch.allclose(a, b, atol=1e-5)  # noqa: E731
    first = audio(tts.synthesize_stream("The same words.", settings=settings))
    made = count_calls(monkeypatch, tts.codec, "init_decode_state")
    again = audio(tts.synthesize_stream("The same words.", settings=settings))
    assert not made and same(again, first)
    open_stream = tts.synthesize_stream("The same words.", settings=settings)
    head = next(open_stream).waveform
    with pytest.raises(InputError, match="already generating"):
        next(tts.synthesize_stream("Another stream.", settings=settings))
    assert len(made) == 1
    rest = audio(open_stream)
    assert same(torch.cat([head, rest], dim=-1), first)
