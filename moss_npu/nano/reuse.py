"""What the frame loop reuses across generations on one model (speed options of ``nano.generate``).

* the local decoder's first-layer q|k|v of every embedding row it can be fed (``local_qkv_tables``);
* the global keys/values of the previous prompt, whose longest shared prefix (the prompt template, a voice-clone
  reference over the chunks of one text) a new prefill starts from (``reuse_prompt_prefix``).
Both are keyed by the weights they were computed from (storage and in-place version of every tensor involved),
so an edited or reloaded model never sees stale values. Each holds one entry per model, dropped with the model.
Shapes: L prompt rows, Q channels, V codebook size, E hidden, H heads, D head dim.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

import torch

from moss_npu.nano.model import KVCache, NanoTTSModel

# Below this many shared rows a copy saves too little to be worth a host sync.
MIN_SHARED_ROWS = 8


def _weights_key(tensors: Iterable[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)


_QKV_TABLES: "weakref.WeakKeyDictionary[NanoTTSModel, tuple]" = weakref.WeakKeyDictionary()


def local_qkv_tables(model: NanoTTSModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Return ``model.first_qkv`` of the text candidates' wte rows (2, 3E) and of audio embedding c's rows (V, 3E)
    for c < Q - 1: every input the local decoder gets after the global hidden state.

    Built once per model (about half a second for the real one) and rebuilt whenever a weight involved changes
    (in-place edits bump a tensor's version), so a stale table cannot be used.
    """
    cfg = model.config
    block = model.local_transformer.h[0]
    sources = [model.transformer.wte.weight, *(e.weight for e in model.audio_embeddings[:-1]),
               *block.ln_1.parameters(), *block.attn.c_attn.parameters()]
    key = _weights_key(sources)
    cached = _QKV_TABLES.get(model)
    if cached is None or cached[0] != key:
        ids = torch.tensor([cfg.audio_assistant_slot_token_id, cfg.audio_end_token_id], device=model.device)
        text = model.first_qkv(model.transformer.wte(ids))
        audio = [model.first_qkv(e.weight) for e in model.audio_embeddings[:-1]]
        cached = _QKV_TABLES[model] = (key, text, audio)
    return cached[1], cached[2]


@dataclass
class PromptEntry:
    """The last prompt run on a model: its rows (L, Q + 1) and the global keys/values per layer (1, H, L, D)."""

    key: tuple
    rows: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


_PROMPTS: "weakref.WeakKeyDictionary[NanoTTSModel, PromptEntry]" = weakref.WeakKeyDictionary()


def reuse_prompt_prefix(model: NanoTTSModel, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Prefill the empty ``cache`` with one prompt (1, L, Q + 1); return the hidden states of the rows computed.

    Rows shared with the start of the previous prompt are copied from it instead of computed (the last row is
    always computed: its hidden state starts the first frame). Same values as a full prefill up to float rounding.
    """
    transformer = model.transformer
    key = (transformer.attn_impl,) + _weights_key([*transformer.parameters(), *transformer.buffers(),
                                                    *model.audio_embeddings.parameters()])
    length = input_ids.shape[1]
    entry = _PROMPTS.get(model)
    shared = 0
    if entry is not None and entry.key == key:
        n = min(entry.rows.shape[0], length - 1)
        if n >= MIN_SHARED_ROWS:
            same = (entry.rows[:n] == input_ids[0, :n]).all(dim=-1)
            shared = int(same.long().cumprod(dim=0).sum())  # one host sync per prompt
    mask = torch.ones(1, length, dtype=torch.bool, device=input_ids.device)
    if shared >= MIN_SHARED_ROWS:
        for layer in range(len(cache.keys)):
            cache.keys[layer][:, :, :shared] = entry.keys[layer][:, :, :shared]
            cache.values[layer][:, :, :shared] = entry.values[layer][:, :, :shared]
        cache.advance(shared)
    hidden = model(input_ids[:, shared:], mask, cache)
    _PROMPTS[model] = PromptEntry(key, input_ids[0].clone(), [k[:, :, :length].clone() for k in cache.keys],
                                  [v[:, :, :length].clone() for v in cache.values])
    return hidden
