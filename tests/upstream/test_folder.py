"""Patched copies of official folders: attention settings rewritten, everything else linked, the user's
folder untouched, the official code found in the folder or a separate code folder."""

import json

import pytest

from moss_npu.device import attention_impl
from moss_npu.errors import CheckpointError
from moss_npu.upstream import load_manifest
from moss_npu.upstream.folder import code_digest, mirror_folder

from .conftest import official_folders, tree_digest


def mirror(component, folder, work, code_dir=None):
    return mirror_folder(component, folder, work, load_manifest(), attn_implementation=attention_impl(),
                         code_dir=code_dir)


def test_tts_copy_asks_for_sdpa_and_links_everything_else(tmp_path):
    tts, _, _ = official_folders(tmp_path / "user")
    before = tree_digest(tts)
    copy = mirror("tts", tts, tmp_path / "work")
    config = json.loads((copy / "config.json").read_text())
    original = json.loads((tts / "config.json").read_text())
    assert config["attn_implementation"] == config["local_transformer_attn_implementation"] == "sdpa"
    assert {k: v for k, v in config.items() if "attn" not in k} == {k: v for k, v in original.items() if "attn" not in k}
    for name in ("model.safetensors", "tokenizer.model", "tokenizer_config.json", "modeling_moss_tts_nano.py"):
        assert (copy / name).read_bytes() == (tts / name).read_bytes()
    assert tree_digest(tts) == before


def test_codec_copy_drops_the_alias_and_fills_a_missing_auto_map(tmp_path):
    _, codec, code = official_folders(tmp_path / "user")
    before = tree_digest(codec)
    copy = mirror("codec", codec, tmp_path / "work", code_dir=code)
    config = json.loads((copy / "config.json").read_text())
    assert config["attention_implementation"] == "sdpa" and "attention_backend" not in config
    assert config["auto_map"]["AutoModel"] == "modeling_moss_audio_tokenizer.MossAudioTokenizerModel"
    assert (copy / "modeling_moss_audio_tokenizer.py").is_file()
    assert tree_digest(codec) == before


def test_eager_on_request(tmp_path):
    tts, _, _ = official_folders(tmp_path / "user")
    copy = mirror_folder("tts", tts, tmp_path / "work", load_manifest(), attn_implementation=attention_impl("eager"))
    config = json.loads((copy / "config.json").read_text())
    assert config["attn_implementation"] == config["local_transformer_attn_implementation"] == "eager"


def test_existing_auto_map_is_kept(tmp_path):
    _, codec, code = official_folders(tmp_path / "user", codec_auto_map=True)
    copy = mirror("codec", codec, tmp_path / "work", code_dir=code)
    assert json.loads((copy / "config.json").read_text())["auto_map"] == {
        "AutoModel": "modeling_moss_audio_tokenizer.MossAudioTokenizerModel"}


def test_code_folder_wins_over_code_in_the_model_folder(tmp_path):
    tts, _, code = official_folders(tmp_path / "user")
    (tts / "modeling_moss_tts_nano.py").write_text("# an older copy\n")
    copy = mirror("tts", tts, tmp_path / "work", code_dir=code)
    assert (copy / "modeling_moss_tts_nano.py").read_text() != "# an older copy\n"


def test_copy_name_follows_the_code_so_one_revision_loads_once(tmp_path):
    tts, _, code = official_folders(tmp_path / "user")
    first = mirror("tts", tts, tmp_path / "a", code_dir=code)
    second = mirror("tts", tts, tmp_path / "b", code_dir=code)
    assert first.name == second.name == f"moss_tts_{code_digest(code / 'models' / 'llm')}"
    (code / "models" / "llm" / "modeling_moss_tts_nano.py").write_text("# another revision\n")
    assert mirror("tts", tts, tmp_path / "c", code_dir=code).name != first.name


def test_missing_code_names_the_download(tmp_path):
    tts, _, _ = official_folders(tmp_path / "user", tts_code=False)
    with pytest.raises(CheckpointError, match="python -m moss_npu.hub download OpenMOSS-Team/MOSS-TTS-Nano"):
        mirror("tts", tts, tmp_path / "work")


def test_folder_of_another_model_is_refused(tmp_path):
    tts, _, _ = official_folders(tmp_path / "user")
    config = json.loads((tts / "config.json").read_text())
    (tts / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(CheckpointError, match="model_type='gpt2'.*tts-config-attention"):
        mirror("tts", tts, tmp_path / "work")


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="lacks config.json"):
        mirror("tts", tmp_path / "empty", tmp_path / "work")
