"""MOSS-Audio-Tokenizer-Nano, native: ``load_codec`` an official folder into a ``NanoCodec`` (``encode``,
``decode``, ``init_decode_state``, ``decode_step``). docs/architecture.md#the-codec.
"""

from moss_npu.codec.checkpoint import load_codec
from moss_npu.codec.model import NanoCodec
from moss_npu.codec.streaming import OFFICIAL_SCHEDULE, CodecDecodeState, DecodeSchedule
