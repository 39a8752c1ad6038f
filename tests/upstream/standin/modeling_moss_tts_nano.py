"""Stand-in for the official modeling_moss_tts_nano.py: the patched methods keep their official signatures
and CUDA-only behaviour; generation is a seeded random draw and the waveform a constant, which is all
the wrapper tests need."""

from types import SimpleNamespace

import torch
from torch import nn


class _TorchaudioWithoutTorchcodec:
    """What ``import torchaudio`` gives on torchaudio >= 2.9 without torchcodec: load and save fail."""

    @staticmethod
    def load(*args, **kwargs):
        raise ImportError("TorchCodec is required for load_with_torchcodec")

    @staticmethod
    def save(*args, **kwargs):
        raise ImportError("TorchCodec is required for save_with_torchcodec")


torchaudio = _TorchaudioWithoutTorchcodec()
# Official: a waveform sample may exceed 1.0, and torchaudio.save keeps it (float32 WAV, no clipping).
LOUD_SAMPLE = 1.5


class MossTTSNanoForCausalLM(nn.Module):
    def __init__(self, hidden_size=8):
        super().__init__()
        self.config = SimpleNamespace(n_vq=16, audio_assistant_slot_token_id=9, audio_end_token_id=7, audio_pad_token_id=1024)
        self.text_lm_head = nn.Linear(hidden_size, 16, bias=False)
        self.audio_lm_head = nn.Linear(hidden_size, 1024, bias=False)
        self.attn_implementation = "flash_attention_2"

    # --- the patched spots, as upstream ---

    @staticmethod
    def _select_fallback_attention_implementation(device: torch.device) -> str:
        return "sdpa" if device.type == "cuda" else "eager"

    def _resolve_voice_clone_chunk_batch_size(self, *, resolved_device, chunk_count, max_memory_per_sample_gb):
        if chunk_count <= 1 or max_memory_per_sample_gb <= 0 or resolved_device.type != "cuda":
            return 1
        free_bytes, _ = torch.cuda.mem_get_info(resolved_device)
        return max(1, min(int(chunk_count), int(free_bytes * 0.9) // int(max_memory_per_sample_gb * 1024**3)))

    def _load_reference_audio(self, reference_audio_path, target_sample_rate, target_channels):
        waveform, sample_rate = torchaudio.load(str(reference_audio_path))
        return waveform, sample_rate

    @staticmethod
    def _ensure_finite_generation_logits(logits, name):
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"Non-finite {name}")

    # --- around them, trivially ---

    def _set_attention_implementation(self, attn_implementation, local_attn_implementation=None):
        self.attn_implementation = str(attn_implementation)

    def _apply_inference_stability_fallback(self, device):
        self._set_attention_implementation(self._select_fallback_attention_implementation(device))

    def _split_text_into_best_sentences(self, text_tokenizer, text, max_tokens):
        return [part.strip() for part in text.split("|") if part.strip()]

    def build_inference_input_ids(self, text, text_tokenizer, mode="continuation", prompt_text=None,
                                  prompt_audio_codes=None, device=None):
        ids = torch.tensor(text_tokenizer.encode(text), dtype=torch.long)
        rows = torch.full((ids.numel(), 17), 1024, dtype=torch.long)
        rows[:, 0] = ids
        return rows[None], torch.ones(1, ids.numel(), dtype=torch.bool)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = input_ids[..., :8].float() / 1024.0
        return SimpleNamespace(global_hidden_states=hidden)

    def generate(self, input_ids, attention_mask=None, nq=None, max_new_frames=300, do_sample=False, **sampling):
        hidden = input_ids[:, -1, :8].float()
        frames = []
        for _ in range(max_new_frames):
            self._ensure_finite_generation_logits(self.text_lm_head(hidden), "text logits")
            for channel in range(nq or 16):
                self._ensure_finite_generation_logits(self.audio_lm_head(hidden), f"audio logits[{channel}]")
            frames.append(torch.randint(0, 1024, (1, 16)) if do_sample else torch.zeros(1, 16, dtype=torch.long))
        return SimpleNamespace(audio_token_ids=torch.stack(frames, dim=1))

    def _run(self, text, mode, prompt_audio_path, device, max_new_frames, voice_clone_max_text_tokens,
             voice_clone_max_memory_per_sample_gb, text_tokenizer):
        chunks = self._split_text_into_best_sentences(text_tokenizer, text, voice_clone_max_text_tokens) if mode == "voice_clone" else [text]
        batch = self._resolve_voice_clone_chunk_batch_size(resolved_device=torch.device(device), chunk_count=len(chunks),
                                                           max_memory_per_sample_gb=voice_clone_max_memory_per_sample_gb)
        codes = torch.randint(0, 1024, (max_new_frames, 16))
        waveform = torch.full((2, 4 * max_new_frames), 0.25)
        waveform[0, 0] = LOUD_SAMPLE
        if prompt_audio_path is not None:
            reference, _ = self._load_reference_audio(prompt_audio_path, 48000, 2)
            waveform = torch.cat([reference[:, :4], waveform], dim=-1)
        return chunks, batch, codes, waveform

    @torch.no_grad()
    def inference(self, text, output_audio_path, mode="continuation", prompt_text=None, prompt_audio_path=None,
                  reference_audio_path=None, text_tokenizer=None, text_tokenizer_path=None, audio_tokenizer=None,
                  audio_tokenizer_type=None, audio_tokenizer_pretrained_name_or_path=None, device=None, nq=None,
                  max_new_frames=300, do_sample=False, text_temperature=1.5, text_top_p=1.0, text_top_k=50,
                  audio_temperature=1.7, audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.0,
                  use_kv_cache=True, voice_clone_max_text_tokens=50, voice_clone_max_memory_per_sample_gb=1.0,
                  tts_max_batch_size=0, codec_max_batch_size=0):
        chunks, batch, codes, waveform = self._run(text, mode, prompt_audio_path, device, max_new_frames,
                                                   voice_clone_max_text_tokens, voice_clone_max_memory_per_sample_gb,
                                                   text_tokenizer)
        torchaudio.save(str(output_audio_path), waveform, 48000)
        return {"audio_path": str(output_audio_path), "sample_rate": 48000, "audio_token_ids": codes,
                "waveform": waveform, "reference_audio_token_ids": None, "voice_clone_text_chunks": chunks,
                "voice_clone_chunk_batch_size": batch, "voice_clone_codec_batch_size": 1}

    @torch.no_grad()
    def inference_stream(self, text, output_audio_path, mode="continuation", prompt_text=None, prompt_audio_path=None,
                         reference_audio_path=None, text_tokenizer=None, text_tokenizer_path=None, audio_tokenizer=None,
                         audio_tokenizer_type=None, audio_tokenizer_pretrained_name_or_path=None, device=None, nq=None,
                         max_new_frames=300, do_sample=False, text_temperature=1.5, text_top_p=1.0, text_top_k=50,
                         audio_temperature=1.7, audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.0,
                         use_kv_cache=True, voice_clone_max_text_tokens=50, voice_clone_max_memory_per_sample_gb=1.0,
                         tts_max_batch_size=0, codec_max_batch_size=0):
        chunks, batch, codes, waveform = self._run(text, mode, prompt_audio_path, device, max_new_frames,
                                                   voice_clone_max_text_tokens, voice_clone_max_memory_per_sample_gb,
                                                   text_tokenizer)
        half = waveform.shape[-1] // 2
        for piece in (waveform[:, :half], waveform[:, half:]):
            yield {"type": "audio", "waveform": piece, "sample_rate": 48000}
        torchaudio.save(str(output_audio_path), waveform, 48000)
        yield {"type": "result", "waveform": waveform, "sample_rate": 48000, "audio_token_ids": codes}
