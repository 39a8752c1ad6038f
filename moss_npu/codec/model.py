"""The assembled Nano codec: waveform <-> codes, offline and streaming (docs/architecture.md#the-codec).

Waveform ``(B, C, S)`` -> whole frames -> channels interleaved (L0 R0 L1 R1 ...) -> encoder stages -> residual
LFQ (always fp32, as the official code forces) -> codes ``(Q, B, F)``, and back. Build it with ``load_codec``.
Shapes: B batch, C channels, S samples, Q codebooks, F frames.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moss_npu.codec.config import CodecConfig, PatchStage
from moss_npu.codec.modules import PatchedPretransform, ProjectedTransformer
from moss_npu.codec.quantizer import ResidualLFQ
from moss_npu.codec.streaming import CodecDecodeState
from moss_npu.errors import InputError


def _build_stack(config: CodecConfig, *, encoder: bool, attention: str) -> nn.ModuleList:
    stages = config.encoder_kwargs if encoder else config.decoder_kwargs
    contexts = config.encoder_contexts() if encoder else config.decoder_contexts()
    modules = nn.ModuleList()
    for stage, context in zip(stages, contexts):
        if isinstance(stage, PatchStage):
            modules.append(PatchedPretransform(stage.patch_size, is_downsample=encoder))
        else:
            assert context is not None
            modules.append(ProjectedTransformer(stage, context, attention))
    return modules


class NanoCodec(nn.Module):
    """MOSS-Audio-Tokenizer-Nano with official parameter names (``encoder.*``, ``quantizer.*``, ``decoder.*``)."""

    def __init__(self, config: CodecConfig, attention: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.encoder = _build_stack(config, encoder=True, attention=attention)
        self.quantizer = ResidualLFQ(config.quantizer_kwargs)
        self.decoder = _build_stack(config, encoder=False, attention=attention)

    @property
    def sample_rate(self) -> int:
        """Waveform sample rate in Hz (48 000)."""
        return self.config.sampling_rate

    @property
    def channels(self) -> int:
        """Waveform channels (2)."""
        return self.config.number_channels

    @property
    def frame_size(self) -> int:
        """Samples per channel in one code frame (3840 = 80 ms)."""
        return self.config.downsample_rate

    @property
    def frame_rate_hz(self) -> float:
        """Code frames per second (12.5)."""
        return self.sample_rate / self.frame_size

    @property
    def num_quantizers(self) -> int:
        """Codebooks per frame (16)."""
        return self.config.quantizer_kwargs.num_quantizers

    @property
    def codebook_size(self) -> int:
        """Entries per codebook (1024)."""
        return self.config.quantizer_kwargs.codebook_size

    def _compute_dtype(self) -> torch.dtype:
        for module in self.decoder:
            if isinstance(module, ProjectedTransformer):
                return module.input_proj.weight.dtype
        return torch.float32

    def _device(self) -> torch.device:
        return next(self.quantizer.parameters()).device

    def _check_nq(self, nq: Optional[int], available: int) -> int:
        nq = available if nq is None else nq
        if not 1 <= nq <= min(available, self.num_quantizers):
            raise InputError(f"codec: nq={nq} is out of range; use 1..{min(available, self.num_quantizers)}")
        return nq

    @torch.no_grad()
    def encode(self, wave: torch.Tensor, lengths: Optional[torch.Tensor] = None,
               nq: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``wave (B, C, S)`` at ``sample_rate`` (rows right-padded; ``lengths (B,)`` valid samples, None: all)
        into ``nq`` codebooks (None: all): ``codes (Q, B, F)`` int64, ``F = ceil(S / frame_size)``, and valid frames
        per row ``floor(lengths / frame_size)`` (a trailing partial frame is not a valid frame)."""
        if wave.dim() != 3 or wave.shape[1] != self.channels:
            raise InputError(f"codec.encode: expected a (batch, {self.channels}, samples) waveform, "
                             f"got shape {tuple(wave.shape)}")
        nq = self._check_nq(nq, self.num_quantizers)
        device = self._device()
        b, c, s = wave.shape
        lengths = torch.full((b,), s, dtype=torch.long) if lengths is None else lengths.to(torch.long)
        lengths = lengths.to(device)
        x = wave.to(device=device, dtype=self._compute_dtype())
        if s % self.frame_size:
            x = F.pad(x, (0, self.frame_size - s % self.frame_size))
        factor = self.config.interleave_factor
        if factor > 1:
            x = x.transpose(1, 2).reshape(b, 1, -1)  # (B, 1, C*S): L0 R0 L1 R1 ...
        h, h_lengths = x, lengths * factor
        for module in self.encoder:
            h, h_lengths = module(h, h_lengths)
        codes = self.quantizer.encode(h.float(), h_lengths, nq)
        return codes, h_lengths

    def _run_decoder(self, codes: torch.Tensor, lengths: torch.Tensor,
                     state: Optional[CodecDecodeState] = None) -> torch.Tensor:
        """Quantizer decode, the decoder stages (the transformers streamed against ``state`` when given) and the
        channels taken apart again: ``(B, C, F * frame_size)`` float32."""
        hidden, steps = self.quantizer.decode(codes).to(self._compute_dtype()), lengths
        for i, module in enumerate(self.decoder):
            if state is not None and isinstance(module, ProjectedTransformer):
                hidden, steps = module.stream(hidden, steps, f"decoder.{i}", state)
            else:
                hidden, steps = module(hidden, steps)
        if self.config.interleave_factor > 1:
            hidden = hidden.reshape(hidden.shape[0], -1, self.channels).transpose(1, 2)
        return hidden.float().contiguous()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode codes ``(Q, B, F)`` (any Q <= ``num_quantizers``) into ``(audio (B, C, F*frame_size), lengths)``.

        ``lengths (B,)`` are valid frames per row (None = all F); returned lengths are in samples.
        """
        codes, lengths = self._check_codes(codes, lengths)
        return self._run_decoder(codes, lengths), lengths * self.frame_size

    def _check_codes(self, codes: torch.Tensor,
                     lengths: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if codes.dim() != 3:
            raise InputError(f"codec.decode: expected codes shaped (nq, batch, frames), got {tuple(codes.shape)}")
        self._check_nq(codes.shape[0], codes.shape[0])
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise InputError(f"codec.decode: code values must lie in 0..{self.codebook_size - 1}, got "
                             f"{int(codes.min())}..{int(codes.max())}; drop pad/stop ids before decoding")
        device = self._device()
        b = codes.shape[1]
        lengths = torch.full((b,), codes.shape[2], dtype=torch.long) if lengths is None else lengths.to(torch.long)
        return codes.to(device=device, dtype=torch.long), lengths.to(device)

    def init_decode_state(self, batch_size: int = 1, max_frames_per_step: int = 8) -> CodecDecodeState:
        """Create the streaming decode state for ``batch_size`` rows; ``max_frames_per_step`` sizes the KV rings
        (``decode_step`` splits larger calls into pieces of that many frames)."""
        if batch_size < 1 or max_frames_per_step < 1:
            raise InputError(f"codec.init_decode_state: batch_size={batch_size} and max_frames_per_step="
                             f"{max_frames_per_step} must be >= 1")
        caches = {}
        steps = self.config.decoder_steps_per_frame()
        for i, module in enumerate(self.decoder):
            if isinstance(module, ProjectedTransformer):
                caches.update(module.init_caches(f"decoder.{i}", batch_size, max_frames_per_step * steps[i],
                                                 self._device(), self._compute_dtype()))
        return CodecDecodeState(batch_size=batch_size, max_frames_per_step=max_frames_per_step, caches=caches)

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: CodecDecodeState,
                    lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode the next frames ``codes (Q, B, n)`` of the state's rows [0, B) (later rows are left as they are),
        updating ``state`` in place: O(new frames) work. ``lengths (B,)``: new frames per row when some got fewer
        than n. Returns ``(B, C, n * frame_size)`` float32 audio, zero past a row's ``lengths * frame_size``."""
        codes, lengths = self._check_codes(codes, lengths)
        if codes.shape[1] > state.batch_size:
            raise InputError(f"codec.decode_step: codes have batch {codes.shape[1]}, the state holds "
                             f"{state.batch_size} rows; create a state with enough rows")
        pieces = []
        for start in range(0, codes.shape[2], state.max_frames_per_step):
            piece = codes[:, :, start:start + state.max_frames_per_step]
            piece_lengths = (lengths - start).clamp(0, piece.shape[2])
            pieces.append(self._decode_piece(piece, piece_lengths, state))
        if not pieces:
            return torch.zeros(codes.shape[1], self.channels, 0, device=codes.device)
        return torch.cat(pieces, dim=-1)

    def _decode_piece(self, codes: torch.Tensor, lengths: torch.Tensor, state: CodecDecodeState) -> torch.Tensor:
        audio = self._run_decoder(codes, lengths, state)
        state.frames_processed += codes.shape[2]
        valid = torch.arange(audio.shape[-1], device=audio.device).view(1, -1) < (lengths * self.frame_size).view(-1, 1)
        return audio * valid[:, None, :]
