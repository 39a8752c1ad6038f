"""Builders for the upstream-patch tests: fresh copies of the stand-in remote code, a fake NPU (the real
NpuBackend over a fake ``torch.npu``), and official-format folders (config + weights + tokenizer + code) in a temp dir."""

import hashlib
import itertools
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from moss_npu import device
from moss_npu.upstream import patches

from ..fake_npu import GIB, FakeTorchNpu, install_fake_torch_npu

STANDIN = Path(__file__).resolve().parent / "standin"
_copies = itertools.count()


def load_standin(file_name, replace=()):
    """Import a fresh copy of a stand-in module (its own module-level names), optionally with source edits.

    The copy is registered as ``standin_copyN.<file stem>``, so its classes report the official module
    name as their last component, as the dynamic modules of transformers do.
    """
    source = (STANDIN / file_name).read_text(encoding="utf-8")
    for old, new in replace:
        assert old in source, f"stand-in edit {old!r} matches nothing"
        source = source.replace(old, new)
    name = f"standin_copy{next(_copies)}.{Path(file_name).stem}"
    module = types.ModuleType(name)
    module.__file__ = str(STANDIN / file_name)
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


@pytest.fixture
def npu(monkeypatch):
    """A fake one-card NPU (2.5 GiB free) behind the real NpuBackend; return (torch.device('npu:0'), fake torch.npu)."""
    fake = FakeTorchNpu(free_bytes=int(2.5 * GIB), count=1)
    install_fake_torch_npu(monkeypatch, fake)
    yield torch.device("npu", 0), fake
    device.register_backend("npu", None)


@pytest.fixture(autouse=True)
def _host_autocast_only(monkeypatch):
    """Patching for the stand-in NPU adds "npu" to the process-wide autocast guard; no NPU autocast exists here."""
    monkeypatch.setattr(patches, "_AUTOCAST_KINDS", {"cpu"})


def official_folders(root, *, tts_code=True, codec_auto_map=False):
    """Write official-format TTS and codec folders under ``root`` (flash_attention_2 as published) and
    return (tts_dir, codec_dir, code_dir). Code files come from the stand-in; ``tts_code`` puts the TTS
    code into the TTS folder as a hub download has it, else only into the separate code folder."""
    root = Path(root)
    tts, codec, code = root / "tts", root / "codec", root / "code" / "models" / "llm"
    for folder in (tts, codec, code, root / "code" / "models" / "codec"):
        folder.mkdir(parents=True)
    tts_map = {"AutoConfig": "configuration_moss_tts_nano.MossTTSNanoConfig",
               "AutoModelForCausalLM": "modeling_moss_tts_nano.MossTTSNanoForCausalLM"}
    (tts / "config.json").write_text(json.dumps({
        "model_type": "moss_tts_nano", "attn_implementation": "flash_attention_2",
        "local_transformer_attn_implementation": "flash_attention_2", "auto_map": tts_map, "n_vq": 16}))
    (tts / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_moss_tts_nano.MossTTSNanoSentencePieceTokenizer", None]}}))
    (tts / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (tts / "tokenizer.model").write_bytes(b"spm" * 100)
    codec_config = {"model_type": "moss-audio-tokenizer", "attention_implementation": "flash_attention_2",
                    "attention_backend": "flash_attention_2", "compute_dtype": "fp32"}
    if codec_auto_map:
        codec_config["auto_map"] = {"AutoModel": "modeling_moss_audio_tokenizer.MossAudioTokenizerModel"}
    (codec / "config.json").write_text(json.dumps(codec_config))
    (codec / "model.safetensors").write_bytes(b"\x01" * 512)
    for name in ("configuration_moss_tts_nano.py", "modeling_moss_tts_nano.py", "tokenization_moss_tts_nano.py"):
        shutil.copy(STANDIN / name, code / name)
        if tts_code:
            shutil.copy(STANDIN / name, tts / name)
    for name in ("configuration_moss_audio_tokenizer.py", "modeling_moss_audio_tokenizer.py"):
        shutil.copy(STANDIN / name, root / "code" / "models" / "codec" / name)
    return tts, codec, root / "code"


def tree_digest(folder):
    """Hash every file's path, bytes, mode and mtime below ``folder``: any edit changes it."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        stat = path.lstat()
        digest.update(f"{path.relative_to(folder)}|{stat.st_mode}|{stat.st_mtime_ns}".encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()
