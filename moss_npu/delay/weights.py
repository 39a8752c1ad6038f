"""The Delay weights folder (docs/delay.md#weights-folder): finds and checks every file before anything heavy
loads; shapes come from the ``.npy`` headers, never assumed. H hidden size, V text vocab, A = audio vocab + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moss_npu.delay.config import DelayModelConfig
from moss_npu.errors import CheckpointError


@dataclass(frozen=True)
class DelayWeights:
    """Checked paths and sizes of one weights folder."""

    config: DelayModelConfig
    gguf: Path
    embed_tokens: Path
    emb_ext: tuple[Path, ...]
    lm_head_audio: tuple[Path, ...]
    tokenizer_json: Path
    hidden_size: int
    vocab_size: int

    @classmethod
    def open(cls, root: Path | str, backbone_gguf: Optional[str] = None) -> "DelayWeights":
        """Locate and check the files of the weights folder ``root`` (``--weights``); ``backbone_gguf`` names the GGUF
        inside it (None: the only ``*.gguf`` there). ``CheckpointError`` for a missing file or a table's wrong shape
        or dtype."""
        root = Path(root).expanduser()
        if not root.is_dir():
            raise CheckpointError(f"weights folder {root} does not exist; download OpenMOSS-Team/MOSS-TTS-GGUF "
                                  "there or convert a checkpoint with `python -m moss_npu.delay.convert`")
        config = DelayModelConfig.from_weights_dir(root)
        gguf = _find_gguf(root, backbone_gguf)
        n_vq = config.n_vq
        embed_tokens = _need(root / "embeddings" / "embed_tokens.npy")
        emb_ext = tuple(_need(root / "embeddings" / f"emb_ext_{i:02d}.npy") for i in range(n_vq))
        lm_head_text = _need(root / "lm_heads" / "lm_head_text.npy")
        lm_head_audio = tuple(_need(root / "lm_heads" / f"lm_head_audio_{i:02d}.npy") for i in range(n_vq))
        tokenizer_json = _need(root / "tokenizer" / "tokenizer.json")

        vocab_size, hidden_size = _shape2(embed_tokens)
        if config.hidden_size is not None and hidden_size != config.hidden_size:
            raise CheckpointError(f"{embed_tokens}: hidden size {hidden_size} but config.json says "
                                  f"{config.hidden_size}; the tables and config come from different checkpoints")
        expected_audio = (config.audio_vocab_size + 1, hidden_size)
        for path in emb_ext + lm_head_audio:
            if _shape2(path) != expected_audio:
                raise CheckpointError(f"{path}: shape {_shape2(path)}, expected {expected_audio} "
                                      "(audio_vocab_size + 1 rows incl. the pad row, hidden size columns)")
        if _shape2(lm_head_text) != (vocab_size, hidden_size):
            raise CheckpointError(f"{lm_head_text}: shape {_shape2(lm_head_text)}, expected "
                                  f"{(vocab_size, hidden_size)} like embed_tokens.npy")
        return cls(config, gguf, embed_tokens, emb_ext, lm_head_audio, tokenizer_json, hidden_size, vocab_size)


def _need(path: Path) -> Path:
    if not path.is_file():
        raise CheckpointError(f"missing weights file {path}; the folder must hold the full MOSS-TTS-GGUF layout "
                              "(embeddings/, lm_heads/, tokenizer/, a .gguf and config.json)")
    return path


def _find_gguf(root: Path, name: Optional[str]) -> Path:
    if name:
        return _need(root / name)
    found = sorted(root.glob("*.gguf"))
    if not found:
        raise CheckpointError(f"no .gguf backbone in {root}; download MOSS_TTS_Q4_K_M.gguf (or convert one with "
                              "llama.cpp's convert_hf_to_gguf.py) into that folder")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(f"{root} holds several .gguf files ({names}); choose one with backbone_gguf "
                              "in the preset or --backbone-gguf")
    return found[0]


def load_table(path: Path) -> np.ndarray:
    """Memory-map a 2-D float table (never unpickling), checking it is floating point."""
    try:
        table = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable .npy array ({exc}); re-download or re-convert it") from exc
    if table.ndim != 2 or table.dtype.kind != "f":
        raise CheckpointError(f"{path}: {table.ndim}-D {table.dtype} array, expected a 2-D float table")
    return table


def _shape2(path: Path) -> tuple[int, ...]:
    return tuple(load_table(path).shape)
