"""MOSS-Audio-Tokenizer-Nano, native: load an official codec folder, encode/decode, stream decode.

Public entry points: ``load_codec``, ``NanoCodec`` (``encode``, ``decode``, ``init_decode_state``,
``decode_step``), ``CodecDecodeState``, ``DecodeSchedule`` and ``write_random_codec``.

See docs/architecture.md#the-codec.
"""

from moss_npu.codec.checkpoint import load_codec, nano_codec_config, write_random_codec
from moss_npu.codec.model import NanoCodec
from moss_npu.codec.streaming import OFFICIAL_SCHEDULE, CodecDecodeState, DecodeSchedule
