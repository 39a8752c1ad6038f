"""Every patch of patches/manifest.yaml, applied to the stand-in remote code: it installs, it changes the
CUDA-only behaviour as intended, and a mismatching upstream module is refused with the revision named."""

import numpy as np
import pytest
import soundfile as sf
import torch

from moss_npu import audio
from moss_npu.errors import CheckpointError, ConfigError
from moss_npu.upstream import apply_patches, load_manifest
from moss_npu.upstream.manifest import MANIFEST_PATH
from moss_npu.upstream.patches import REPLACEMENTS, check_replacements

from .conftest import GIB, load_standin

CPU = torch.device("cpu")
REVISION = "20017d781d46fe4307574fe05cc84228b4de9bec"


def standins(tts_edits=(), codec_edits=(), compute_dtype=None):
    tts_module = load_standin("modeling_moss_tts_nano.py", tts_edits)
    codec_module = load_standin("modeling_moss_audio_tokenizer.py", codec_edits)
    return tts_module, codec_module, tts_module.MossTTSNanoForCausalLM(), codec_module.MossAudioTokenizerModel(compute_dtype)


def test_manifest_names_one_replacement_per_entry_and_the_revision():
    manifest = load_manifest()
    check_replacements(manifest)
    assert {e.replacement for e in manifest.entries} == REPLACEMENTS
    assert manifest.revision == REVISION
    for entry in manifest.entries:
        assert entry.revision in (manifest.revision, manifest.runtime_revision), entry.id
        assert entry.why, entry.id


def test_manifest_with_unknown_key_is_refused(tmp_path):
    text = MANIFEST_PATH.read_text(encoding="utf-8").replace("    kind: method\n", "    kind: method\n    colour: red\n", 1)
    (tmp_path / "manifest.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown keys colour"):
        load_manifest(tmp_path / "manifest.yaml")


def test_every_code_patch_installs_on_the_instance_only():
    _, _, model, codec = standins()
    applied = apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    expected = [e.id for e in load_manifest().entries if e.kind in ("method", "function", "module_attr")]
    assert applied == expected
    untouched = type(model)()
    assert untouched._select_fallback_attention_implementation(CPU) == "eager"  # class left as upstream wrote it
    assert model._select_fallback_attention_implementation(CPU) == "sdpa"


def test_stability_fallback_switches_to_sdpa_not_eager():
    _, _, model, codec = standins()
    model._apply_inference_stability_fallback(CPU)
    assert model.attn_implementation == "eager"  # upstream: eager on anything but CUDA
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    model._apply_inference_stability_fallback(CPU)
    assert model.attn_implementation == "sdpa"


@pytest.mark.parametrize("free_gib, chunks, expected", [
    pytest.param(2.5, 5, 2, id="memory-bound"),    # floor(0.9 * 2.5 GiB / 1 GiB) = 2
    pytest.param(40, 5, 5, id="chunk-bound"),
    pytest.param(0.5, 5, 1, id="at-least-one"),
])
def test_chunk_batch_size_comes_from_the_device_layer_memory_query(npu, free_gib, chunks, expected):
    npu_device, backend = npu
    backend.free_bytes = int(free_gib * GIB)
    _, _, model, codec = standins()
    kwargs = dict(resolved_device=npu_device, chunk_count=chunks, max_memory_per_sample_gb=1.0)
    assert model._resolve_voice_clone_chunk_batch_size(**kwargs) == 1  # upstream: CUDA only
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=npu_device)
    assert model._resolve_voice_clone_chunk_batch_size(**kwargs) == expected
    assert ("mem_get_info", 0) in backend.calls


def test_chunk_batch_size_stays_one_on_the_host():
    _, _, model, codec = standins()
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    assert model._resolve_voice_clone_chunk_batch_size(resolved_device=CPU, chunk_count=4, max_memory_per_sample_gb=1.0) == 1


def test_reference_audio_is_read_through_moss_npu_audio(tmp_path):
    path = tmp_path / "ref.wav"
    sf.write(path, np.sin(np.arange(16000) / 7.0).astype(np.float32) * 0.5, 16000, subtype="PCM_16")
    _, _, model, codec = standins()
    with pytest.raises(ImportError, match="TorchCodec"):
        model._load_reference_audio(path, 48000, 2)
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    wave, rate = model._load_reference_audio(path, 48000, 2)
    assert rate == 48000 and wave.dtype == torch.float32 and wave.shape == (2, 48000)
    torch.testing.assert_close(wave, audio.load_reference_audio(path, 48000, 2), rtol=0, atol=0)


def test_inference_writes_its_wav_through_moss_npu_audio(tmp_path):
    tts_module, _, model, codec = standins()
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    out = model.inference("hi", output_audio_path=tmp_path / "out.wav", device=CPU, max_new_frames=3)
    written, rate = sf.read(tmp_path / "out.wav", dtype="float32", always_2d=True)
    assert rate == 48000 and sf.info(tmp_path / "out.wav").subtype == "FLOAT"
    np.testing.assert_array_equal(written.T, out["waveform"].numpy())
    assert written[0, 0] == tts_module.LOUD_SAMPLE  # float WAV, no clipping, as torchaudio.save


def test_codec_autocast_follows_the_codec_device():
    _, _, model, codec = standins(compute_dtype=torch.bfloat16)
    x = torch.ones(2, 4)
    assert codec.decode_frame(x).dtype == torch.float32  # upstream: autocast on CUDA only
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    assert codec.decode_frame(x).dtype == torch.bfloat16


def test_codec_fp32_config_runs_without_autocast():
    _, _, model, codec = standins(compute_dtype=None)
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert codec.decode_frame(torch.ones(2, 4)).dtype == torch.bfloat16  # the caller's autocast is left alone
    assert codec.decode_frame(torch.ones(2, 4)).dtype == torch.float32


def test_quantizer_guard_disables_autocast_on_the_device_in_use():
    _, _, model, codec = standins()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert codec.quantize(torch.ones(2, 4)).dtype == torch.bfloat16  # upstream: disables CUDA autocast only
    apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert codec.quantize(torch.ones(2, 4)).dtype == torch.float32


def test_patching_twice_in_one_process_is_stable():
    tts_module, codec_module, model, codec = standins()
    manifest = load_manifest()
    apply_patches({"tts": model, "codec": codec}, manifest, device=CPU)
    guard = codec_module.disable_cuda_autocast
    again = tts_module.MossTTSNanoForCausalLM(), codec_module.MossAudioTokenizerModel()
    apply_patches({"tts": again[0], "codec": again[1]}, manifest, device=CPU)
    assert codec_module.disable_cuda_autocast is guard
    assert again[0]._select_fallback_attention_implementation(CPU) == "sdpa"


@pytest.mark.parametrize("edits, codec_edits, what", [
    pytest.param([("def _resolve_voice_clone_chunk_batch_size(self, *, resolved_device, chunk_count, max_memory_per_sample_gb)",
                   "def _resolve_voice_clone_chunk_batch_size(self, *, resolved_device, chunk_count, max_gb)")], [],
                 "_resolve_voice_clone_chunk_batch_size: parameters are (self, resolved_device, chunk_count, max_gb)", id="renamed-parameter"),
    pytest.param([("def _load_reference_audio(", "def _read_reference_audio(")], [],
                 "_load_reference_audio: not found", id="removed-method"),
    pytest.param([], [("def disable_cuda_autocast():", "def disable_cuda_autocast(device):")],
                 "disable_cuda_autocast: parameters are (device), expected ()", id="changed-function"),
    pytest.param([("torchaudio = _TorchaudioWithoutTorchcodec()", "soundio = _TorchaudioWithoutTorchcodec()")], [],
                 "has no name torchaudio", id="module-name-gone"),
])
def test_mismatching_upstream_is_refused_with_the_revision_named(edits, codec_edits, what):
    _, _, model, codec = standins(edits, codec_edits)
    with pytest.raises(CheckpointError) as err:
        apply_patches({"tts": model, "codec": codec}, load_manifest(), device=CPU)
    message = str(err.value)
    assert what in message and REVISION in message and "\n" not in message
    # checked before anything is replaced: nothing was patched
    assert "_select_fallback_attention_implementation" not in vars(model)


def test_object_from_another_module_is_refused():
    _, _, model, codec = standins()
    with pytest.raises(CheckpointError, match="comes from module .*not modeling_moss_audio_tokenizer"):
        apply_patches({"tts": model, "codec": torch.nn.Linear(2, 2)}, load_manifest(), device=CPU)
