import pytest

from moss_npu.errors import ConfigError
from moss_npu.nano.config import NanoConfig, load_config
from moss_npu_verify.random_checkpoints import official_config_dict


def test_official_config_reads_with_official_names():
    cfg = NanoConfig.from_dict(official_config_dict())
    assert (cfg.n_vq, cfg.hidden_size, cfg.gpt2_config.n_layer, cfg.local_transformer_layers) == (16, 768, 12, 1)
    assert cfg.audio_codebook_sizes == (1024,) * 16
    assert cfg.gpt2_config.head_dim == 64 and cfg.gpt2_config.inner_size == 3072
    assert cfg.audio_assistant_slot_token_id == 9 and cfg.audio_end_token_id == 7
    # flash_attention_2 in the file is recorded, not rejected (the caller picks the attention).
    assert cfg.attn_implementation == "flash_attention_2"


def test_unknown_keys_kept():
    data = official_config_dict()
    data["some_future_key"] = {"a": 1}
    cfg = NanoConfig.from_dict(data)
    assert cfg.extra["some_future_key"] == {"a": 1}


@pytest.mark.parametrize("change,needle", [
    ({"audio_codebook_sizes": [1024] * 15}, "n_vq"),
    ({"audio_pad_token_id": 1000}, "audio_pad_token_id"),
    ({"audio_vocab_size": 512}, "audio_vocab_size"),
    ({"audio_codebook_sizes": [0] + [1024] * 15}, "positive"),
    ({"audio_tokenizer_type": "other"}, "audio_tokenizer_type"),
])
def test_official_validation(change, needle):
    data = official_config_dict()
    data.update(change)
    with pytest.raises(ConfigError, match=needle):
        NanoConfig.from_dict(data)


def test_codebook_sizes_default_from_vocab():
    data = official_config_dict()
    del data["audio_codebook_sizes"]
    data["n_vq"] = 4
    assert NanoConfig.from_dict(data).audio_codebook_sizes == (1024,) * 4


def test_gpt2_checks():
    data = official_config_dict()
    data["gpt2_config"]["n_head"] = 5
    with pytest.raises(ConfigError, match="divisible"):
        NanoConfig.from_dict(data)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        load_config(tmp_path)
