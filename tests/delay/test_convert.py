"""Checkpoint conversion on a tiny synthetic MOSS-TTS checkpoint the test builds (bf16, two shards)."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moss_npu.delay.convert import convert, main
from moss_npu.delay.prompt import DelayTokenizer
from moss_npu.delay.weights import DelayWeights
from moss_npu.errors import CheckpointError

from .conftest import write_tokenizer

N_VQ, HIDDEN, VOCAB = 32, 8, 32


def _tensors():
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    tensors = {"language_model.embed_tokens.weight": rand(VOCAB, HIDDEN),
               "language_model.norm.weight": rand(HIDDEN),
               "language_model.layers.0.self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
               "language_model.layers.0.mlp.up_proj.weight": rand(2 * HIDDEN, HIDDEN)}
    tensors.update({f"emb_ext.{i}.weight": rand(1025, HIDDEN) for i in range(N_VQ)})
    tensors.update({f"lm_heads.{k}.weight": rand(VOCAB if k == 0 else 1025, HIDDEN) for k in range(N_VQ + 1)})
    return tensors


def make_checkpoint(folder, extra=None):
    """Write config.json, tokenizer.json and the tensors split over two safetensors shards with an index."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder / "tokenizer.json")
    tensors = dict(_tensors(), **(extra or {}))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    config = {"architectures": ["MossTTSDelayModel"], "n_vq": N_VQ, "audio_vocab_size": 1024, "audio_pad_code": 1024,
              "sampling_rate": 24000, **ids,
              "language_config": {"_name_or_path": "Qwen/Qwen3-8B", "model_type": "qwen3", "hidden_size": HIDDEN,
                                  "vocab_size": VOCAB, "num_hidden_layers": 1}}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def test_convert_streams_every_tensor_to_its_place(tmp_path):
    tensors = make_checkpoint(tmp_path / "ckpt")
    out = convert(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=200)
    text = np.load(out / "embeddings" / "embed_tokens.npy")
    assert text.dtype == np.float16
    assert np.array_equal(text, tensors["language_model.embed_tokens.weight"].to(torch.float16).numpy())
    assert np.array_equal(np.load(out / "lm_heads" / "lm_head_audio_00.npy"),
                          tensors["lm_heads.1.weight"].to(torch.float16).numpy())
    assert np.array_equal(np.load(out / "embeddings" / "emb_ext_31.npy"),
                          tensors["emb_ext.31.weight"].to(torch.float16).numpy())
    qwen = out / "qwen3_backbone"
    index = json.loads((qwen / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                          "model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
    assert len(set(index.values())) > 1  # 200-byte shards force several files
    for key, file in index.items():
        with safe_open(str(qwen / file), framework="pt") as f:
            got = f.get_tensor(key)
        source = "lm_heads.0.weight" if key == "lm_head.weight" else "language_model." + key[len("model."):]
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensors[source])
    config = json.loads((qwen / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "_name_or_path" not in config
    assert config["torch_dtype"] == "bfloat16"
    assert (qwen / "tokenizer.json").is_file()


def test_converted_folder_passes_the_weights_check_once_a_gguf_is_added(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    out = convert(tmp_path / "ckpt", tmp_path / "out")
    assert (out / "qwen3_backbone" / "model.safetensors").is_file()  # one shard, no index
    (out / "MOSS_TTS_F16.gguf").write_bytes(b"GGUF")
    weights = DelayWeights.open(out)
    DelayTokenizer(weights.tokenizer_json, weights.config)
    meta = json.loads((out / "extraction_meta.json").read_text())
    assert (meta["hidden_size"], meta["vocab_size"], meta["n_vq"]) == (HIDDEN, VOCAB, N_VQ)


def test_unknown_tensors_are_refused(tmp_path):
    make_checkpoint(tmp_path / "ckpt", extra={"mystery.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="mystery.weight"):
        convert(tmp_path / "ckpt", tmp_path / "out")


def test_cli_exit_codes(tmp_path, capsys):
    make_checkpoint(tmp_path / "ckpt")
    assert main(["--model", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert main(["--model", str(tmp_path / "nothing"), "--output", str(tmp_path / "o2"), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_missing_tokenizer_is_refused_before_anything_is_written(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        convert(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    from moss_npu.delay import convert as module

    make_checkpoint(tmp_path / "ckpt")

    def broken_save(f, array, allow_pickle):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(module.np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        convert(tmp_path / "ckpt", tmp_path / "out")
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.endswith(".tmp")]


def test_without_torch_the_converter_names_its_install(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["--model", str(tmp_path), "--output", str(tmp_path / "out"), "--quiet"]) == 2
    assert 'pip install -e ".[nano]"' in capsys.readouterr().err
