"""load_upstream wiring, with a stand-in ``transformers`` whose Auto classes build the stand-in remote code:
what from_pretrained is asked for, the patched configs it sees, the torchaudio stand-in during the import,
and that neither the user's folders nor a temporary copy are left changed or behind."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from moss_npu.errors import CheckpointError, ConfigError
from moss_npu.upstream import load_upstream
from moss_npu.upstream.patches import _MARK

from .conftest import load_standin, official_folders, tree_digest

CPU = torch.device("cpu")
REVISION = "20017d781d46fe4307574fe05cc84228b4de9bec"


class _Auto:
    """One Auto class: records each call, then builds the stand-in object (honouring attn_implementation)."""

    def __init__(self, calls, file_name, class_name, honour_attention=True):
        self.calls, self.file_name, self.class_name, self.honour = calls, file_name, class_name, honour_attention

    def from_pretrained(self, path, **kwargs):
        self.calls.append({"path": Path(path), "kwargs": kwargs, "config": json.loads((Path(path) / "config.json").read_text()),
                           "torchaudio": sys.modules.get("torchaudio")})
        obj = getattr(load_standin(self.file_name), self.class_name)()
        if self.honour and "attn_implementation" in kwargs:
            obj.attn_implementation = kwargs["attn_implementation"]
        return obj


def fake_transformers(monkeypatch, honour_attention=True):
    calls = []
    module = types.ModuleType("transformers")
    module.__version__ = "4.57.1"
    module.AutoModelForCausalLM = _Auto(calls, "modeling_moss_tts_nano.py", "MossTTSNanoForCausalLM", honour_attention)
    module.AutoModel = _Auto(calls, "modeling_moss_audio_tokenizer.py", "MossAudioTokenizerModel")
    module.AutoTokenizer = _Auto(calls, "tokenization_moss_tts_nano.py", "MossTTSNanoSentencePieceTokenizer")
    monkeypatch.setitem(sys.modules, "transformers", module)
    return calls


def test_load_asks_for_remote_code_on_patched_copies_and_leaves_nothing_behind(monkeypatch, tmp_path):
    tts_dir, codec_dir, code = official_folders(tmp_path / "user")
    before = tree_digest(tmp_path / "user")
    previous_torchaudio = sys.modules.get("torchaudio")
    calls = fake_transformers(monkeypatch)
    tts = load_upstream(str(tts_dir), str(codec_dir), device=CPU, dtype=torch.float32, code_dir=str(code))

    model_call, codec_call, tokenizer_call = calls
    for call in calls:
        assert call["kwargs"]["trust_remote_code"] is True and call["kwargs"]["local_files_only"] is True
        assert getattr(call["torchaudio"], _MARK, None) == "audio_io"  # the import of the official code is answered
        assert not call["path"].exists()  # the temporary copy is gone once loading is over
    assert model_call["kwargs"]["attn_implementation"] == "sdpa" and model_call["kwargs"]["dtype"] == torch.float32
    assert model_call["config"]["attn_implementation"] == model_call["config"]["local_transformer_attn_implementation"] == "sdpa"
    assert codec_call["config"]["attention_implementation"] == "sdpa"
    assert tokenizer_call["path"] == model_call["path"]
    assert sys.modules.get("torchaudio") is previous_torchaudio
    assert tree_digest(tmp_path / "user") == before
    assert len(tts.applied) == 6 and tts.sample_rate == 48000


def test_model_that_ignores_the_attention_setting_is_refused(monkeypatch, tmp_path):
    tts_dir, codec_dir, code = official_folders(tmp_path / "user")
    fake_transformers(monkeypatch, honour_attention=False)
    with pytest.raises(CheckpointError, match=f"flash_attention_2.*wanted sdpa.*{REVISION}"):
        load_upstream(str(tts_dir), str(codec_dir), device=CPU, code_dir=str(code))


def test_folder_without_the_official_code_is_refused_before_loading(monkeypatch, tmp_path):
    tts_dir, codec_dir, _ = official_folders(tmp_path / "user", tts_code=False)
    calls = fake_transformers(monkeypatch)
    with pytest.raises(CheckpointError, match="modeling_moss_tts_nano.py.* not found"):
        load_upstream(str(tts_dir), str(codec_dir), device=CPU)
    assert calls == []


def test_too_old_transformers_is_refused(monkeypatch, tmp_path):
    fake_transformers(monkeypatch)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.3")
    with pytest.raises(ConfigError, match=r"transformers >= 4.57, found 4.46.3: pip install"):
        load_upstream("OpenMOSS-Team/MOSS-TTS-Nano", device=CPU)


def test_inference_cli_writes_the_official_waveform(monkeypatch, tmp_path):
    """``inference.py --impl upstream`` runs the official ``inference`` and writes the waveform it returns."""
    import soundfile as sf

    import inference

    tts_dir, codec_dir, code = official_folders(tmp_path / "user")
    fake_transformers(monkeypatch)
    out = tmp_path / "u.wav"
    assert inference.main(["--impl", "upstream", "--model", str(tts_dir), "--codec", str(codec_dir), "--upstream-code",
                           str(code), "--device", "cpu", "--text", "hello", "--max-new-frames", "5", "--quiet",
                           "--output", str(out)]) == 0
    wave, rate = sf.read(out, dtype="float32", always_2d=True)
    official = torch.full((2, 4 * 5), 0.25)  # the stand-in's waveform for 5 frames, its first sample loud
    official[0, 0] = load_standin("modeling_moss_tts_nano.py").LOUD_SAMPLE
    assert rate == 48000 and torch.equal(torch.from_numpy(wave.T.copy()), official)
