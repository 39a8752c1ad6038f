"""Offline encode/decode of the native codec: layout, padding, codebook prefixes, dtypes, refusals."""

import pytest
import torch

from moss_npu.codec import load_codec
from moss_npu.codec.modules import PatchedPretransform
from moss_npu.errors import InputError


def _wave(batch=1, seconds=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(batch, 2, int(48000 * seconds), generator=g)


def test_patch_layout_and_round_trip():
    """Output channel c*h + j at step t is input channel c at time t*h + j (docs/architecture.md#codec-stages)."""
    x = torch.arange(2 * 12, dtype=torch.float32).view(1, 2, 12)
    patched, lengths = PatchedPretransform(3, is_downsample=True)(x, torch.tensor([11]))
    assert lengths.item() == 3  # floor: a patch holding padding is not valid
    for c in range(2):
        for j in range(3):
            assert torch.equal(patched[0, c * 3 + j], x[0, c, j::3])
    back, back_lengths = PatchedPretransform(3, is_downsample=False)(patched, lengths)
    assert torch.equal(back, x) and back_lengths.item() == 9


def test_codec_facts(small_codec):
    assert (small_codec.sample_rate, small_codec.channels, small_codec.frame_size) == (48000, 2, 3840)
    assert small_codec.num_quantizers == 16 and small_codec.frame_rate_hz == 12.5


def test_partial_last_frame_is_padded_but_not_counted(small_codec):
    wave = _wave(seconds=0.1)  # 4800 samples = 1.25 frames
    codes, lengths = small_codec.encode(wave)
    assert codes.shape == (16, 1, 2) and codes.dtype == torch.int64 and lengths.tolist() == [1]
    audio, audio_lengths = small_codec.decode(codes[:, :, :1])
    assert audio.shape == (1, 2, 3840) and audio.dtype == torch.float32 and audio_lengths.tolist() == [3840]


def test_padding_in_a_batch_does_not_change_valid_codes(small_codec):
    """Causal windows and length masks keep a short row's codes equal to encoding it alone."""
    long, short = _wave(seconds=0.48, seed=1), _wave(seconds=0.24, seed=2)
    batch = torch.zeros(2, 2, long.shape[-1])
    batch[0], batch[1, :, : short.shape[-1]] = long[0], short[0]
    codes, lengths = small_codec.encode(batch, lengths=torch.tensor([long.shape[-1], short.shape[-1]]))
    assert lengths.tolist() == [6, 3]
    assert torch.equal(codes[:, 0], small_codec.encode(long)[0][:, 0])
    assert torch.equal(codes[:, 1, :3], small_codec.encode(short)[0][:, 0])


def test_fewer_codebooks_encode_a_prefix(small_codec):
    """Residual stage i never depends on later stages, so nq=k codes are the first k of nq=16."""
    wave = _wave()
    full, _ = small_codec.encode(wave)
    part, _ = small_codec.encode(wave, nq=5)
    assert part.shape[0] == 5 and torch.equal(part, full[:5])


def test_decode_with_fewer_codebooks_ignores_the_rest(small_codec_dir):
    """Decoding nq=6 equals a full decode where codebooks 6..15 contribute nothing."""
    codec = load_codec(small_codec_dir)
    codes = torch.randint(0, 1024, (16, 1, 5), generator=torch.Generator().manual_seed(3))
    part, _ = codec.decode(codes[:6])
    with torch.no_grad():
        for quantizer in codec.quantizer.quantizers[6:]:
            quantizer.out_proj.weight.zero_()
            quantizer.out_proj.bias.zero_()
    full, _ = codec.decode(codes)
    torch.testing.assert_close(part, full, rtol=0, atol=1e-6)


def test_eager_attention_matches_sdpa(small_codec_dir, small_codec):
    eager = load_codec(small_codec_dir, attention="eager")
    codes = torch.randint(0, 1024, (16, 1, 6), generator=torch.Generator().manual_seed(4))
    a, _ = small_codec.decode(codes)
    b, _ = eager.decode(codes)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_bfloat16_stages_return_float32_audio(small_codec_dir, small_codec):
    codec = load_codec(small_codec_dir, dtype=torch.bfloat16)
    assert codec.quantizer.quantizers[0].codebook.weight.dtype == torch.float32  # quantizer stays fp32
    codes = torch.randint(0, 1024, (16, 1, 3), generator=torch.Generator().manual_seed(5))
    audio, _ = codec.decode(codes)
    ref, _ = small_codec.decode(codes)
    assert audio.dtype == torch.float32
    assert torch.linalg.vector_norm(audio - ref) < 0.1 * torch.linalg.vector_norm(ref)


@pytest.mark.parametrize("codes, match", [
    (torch.full((16, 1, 2), 1024), "0..1023"),
    (torch.zeros(17, 1, 2, dtype=torch.long), "nq=17"),
    (torch.zeros(16, 2, dtype=torch.long), "nq, batch, frames"),
], ids=["pad-id", "too-many-codebooks", "2d"])
def test_bad_codes_raise(small_codec, codes, match):
    with pytest.raises(InputError, match=match):
        small_codec.decode(codes)


def test_mono_wave_is_refused_by_a_stereo_codec(small_codec):
    with pytest.raises(InputError, match="2, samples"):
        small_codec.encode(torch.zeros(1, 1, 3840))


def test_blockwise_offline_attention_equals_single_call(small_codec, monkeypatch):
    """Long sequences attend in query blocks; with tiny thresholds every stage takes that path."""
    from moss_npu.codec import modules

    codes = torch.randint(0, 1024, (16, 2, 9), generator=torch.Generator().manual_seed(6))
    lengths = torch.tensor([9, 5])
    single, _ = small_codec.decode(codes, lengths)
    wave = _wave(batch=2, seconds=0.4)
    single_codes, _ = small_codec.encode(wave)
    monkeypatch.setattr(modules, "FULL_ATTENTION_MAX_STEPS", 8)
    monkeypatch.setattr(modules, "ATTENTION_BLOCK_STEPS", 5)
    blocked, _ = small_codec.decode(codes, lengths)
    assert (blocked - single).abs().max() <= 1e-5 * single.abs().max()
    assert torch.equal(small_codec.encode(wave)[0], single_codes)
