"""Tiny random codecs in the official on-disk format, written once per session."""

import pytest

from moss_npu.codec import load_codec
from moss_npu_verify.random_checkpoints import small_codec_overrides, write_random_codec

# Windows of 10/16/24/32 decoder steps (4 frames at 50 Hz down to 1 frame at 400 Hz): a 12-frame stream
# already slides past every window, so streaming tests exercise eviction without long inputs.
SHORT_CONTEXT_SCALE = 0.02


@pytest.fixture(scope="session")
def small_codec_dir(tmp_path_factory):
    return write_random_codec(tmp_path_factory.mktemp("codec"), small_codec_overrides(context_scale=SHORT_CONTEXT_SCALE),
                              seed=1)


@pytest.fixture(scope="session")
def small_codec(small_codec_dir):
    return load_codec(small_codec_dir, device="cpu")
