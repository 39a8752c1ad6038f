"""UpstreamTTS over the stand-in remote code (no transformers needed): the CLI-facing calls, seeding and
cache clearing through the device layer, logits observation for eval_accuracy, and load errors."""

import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from moss_npu.errors import ConfigError, InputError
from moss_npu.upstream import UpstreamTTS, load_upstream

from .conftest import load_standin

CPU = torch.device("cpu")


def standin_tts(device=CPU):
    tts_module = load_standin("modeling_moss_tts_nano.py")
    codec_module = load_standin("modeling_moss_audio_tokenizer.py")
    tokenizer = load_standin("tokenization_moss_tts_nano.py").MossTTSNanoSentencePieceTokenizer()
    return UpstreamTTS(tts_module.MossTTSNanoForCausalLM(), codec_module.MossAudioTokenizerModel(), tokenizer,
                       device=device, dtype=torch.float32)


def test_infer_returns_host_stereo_float32_and_the_rate():
    tts = standin_tts()
    result = tts.infer("hello", max_new_frames=5)
    wave, rate = result.waveform, result.sample_rate
    assert rate == 48000 and wave.dtype == torch.float32 and wave.shape == (2, 20) and wave.device == CPU


def test_output_path_is_written_by_the_official_save(tmp_path):
    tts = standin_tts()
    result = tts.infer("hello", output_path=str(tmp_path / "a.wav"), max_new_frames=4)
    written, rate = sf.read(tmp_path / "a.wav", dtype="float32", always_2d=True)
    np.testing.assert_array_equal(written.T, result.waveform.numpy())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]  # atomic: no temp file left


def test_voice_clone_reads_the_reference_and_batches_chunks_on_the_npu(npu, tmp_path):
    npu_device, backend = npu
    sf.write(tmp_path / "ref.wav", np.full(4800, 0.125, np.float32), 48000)  # mono: up-mixed to stereo
    tts = standin_tts(npu_device)
    result = tts.infer("one | two | three", mode="voice_clone", prompt_audio_path=str(tmp_path / "ref.wav"), max_new_frames=2)
    assert result.text_chunks == ("one", "two", "three")
    assert result.chunk_batch_size == 2  # floor(0.9 * 2.5 GiB / 1 GiB) from the stand-in NPU's memory answer
    torch.testing.assert_close(result.waveform[:, :4], torch.full((2, 4), 0.125))


def test_seed_goes_through_the_device_layer(npu):
    npu_device, backend = npu
    tts = standin_tts(npu_device)
    first = tts.infer("x", seed=7, do_sample=True, max_new_frames=6).codes
    second = tts.infer("x", seed=7, do_sample=True, max_new_frames=6).codes
    other = tts.infer("x", seed=8, do_sample=True, max_new_frames=6).codes
    assert torch.equal(first, second) and not torch.equal(first, other)
    # per seeded call, torch.manual_seed reaches the NPU module and the device layer seeds it explicitly
    assert backend.calls.count(("manual_seed_all", 7)) == 2 * 2


def test_close_frees_the_device_cache(npu):
    npu_device, backend = npu
    with standin_tts(npu_device) as tts:
        pass
    assert tts.model is None and ("empty_cache",) in backend.calls


def test_stream_yields_the_official_audio_events():
    tts = standin_tts()
    chunks = list(tts.stream("hello", max_new_frames=4))
    assert [c.shape for c in chunks] == [(2, 8), (2, 8)]
    torch.testing.assert_close(torch.cat(chunks, -1), tts.infer("hello", max_new_frames=4).waveform)


def test_unknown_generation_parameter_is_refused_with_the_official_names():
    with pytest.raises(InputError, match="unknown generation parameters max_frames; .*max_new_frames"):
        standin_tts().infer("hello", max_frames=3)


def test_generate_codes_records_every_logits_row_then_stops_observing():
    tts = standin_tts()
    rows = tts.prompt_rows("abc")
    assert rows.shape == (3, 17)
    out = tts.generate_codes(rows, max_new_frames=3, nq=4, record_logits=True)
    assert out.codes.shape == (3, 16)
    assert out.text_logits.shape == (3, 2)  # [slot, end] columns of each text row
    assert out.audio_logits.shape == (3 * 4, 1024)
    assert "_ensure_finite_generation_logits" not in vars(tts.model)
    assert tts.generate_codes(rows, max_new_frames=2).text_logits is None


def test_codec_round_trip_shapes():
    tts = standin_tts()
    codes = tts.encode_audio(torch.zeros(2, 40))
    assert codes.shape == (16, 1, 10)
    assert tts.decode_codes(codes).shape == (1, 2, 40)


def test_missing_transformers_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[upstream\]"'):
        load_upstream("OpenMOSS-Team/MOSS-TTS-Nano", device=CPU)
