"""Stand-in for the official codec module: the autocast guards exactly as upstream (CUDA only), a linear
map instead of the codec, so a matmul's dtype shows which autocast is active."""

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch import nn


@contextmanager
def disable_cuda_autocast():
    with torch.autocast(device_type="cuda", enabled=False):
        yield


class MossAudioTokenizerModel(nn.Module):
    def __init__(self, compute_dtype=None):
        super().__init__()
        self.sampling_rate = 48000
        self.number_channels = 2
        self.downsample_rate = 4
        self.compute_dtype = compute_dtype
        self.proj = nn.Linear(4, 4, bias=False)

    @contextmanager
    def _codec_inference_autocast(self):
        device = next(self.parameters()).device
        if device.type == "cuda" and self.compute_dtype is not None:
            with torch.autocast(device_type="cuda", dtype=self.compute_dtype):
                yield
        else:
            yield

    def quantize(self, x):
        """Like the quantizers: full precision inside disable_cuda_autocast."""
        with disable_cuda_autocast():
            return self.proj(x)

    def decode_frame(self, x):
        """Like _decode_frame: the decoder stack runs inside _codec_inference_autocast."""
        with self._codec_inference_autocast():
            return self.proj(x)

    def encode(self, input_values, padding_mask=None, num_quantizers=None, return_dict=None, chunk_duration=None):
        frames = input_values.shape[-1] // self.downsample_rate
        codes = torch.arange(16 * frames).reshape(16, 1, frames) % 1024
        return SimpleNamespace(audio_codes=codes, audio_codes_lengths=torch.tensor([frames]))

    def decode(self, audio_codes, padding_mask=None, return_dict=None, chunk_duration=None, num_quantizers=None):
        frames = audio_codes.shape[-1]
        return SimpleNamespace(audio=torch.full((1, 2, frames * self.downsample_rate), 0.5))
