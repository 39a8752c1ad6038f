"""Convert an official MOSS-TTS (Delay) checkpoint into the llama.cpp weights layout
(docs/delay.md#building-a-cann-backbone), tensor by tensor: each is read alone (``safe_open``) and written out
before the next, so peak memory stays about one tensor.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from moss_npu.delay.config import DelayModelConfig
from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import CheckpointError, DeviceError
from moss_npu.hub import download_command
from moss_npu.output import write_json

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 1024 ** 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "merges.txt", "vocab.json")
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Tensor:
    """One source tensor: where it lives and what it is, read from the safetensors header only."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_BYTES[self.dtype]


def read_index(model_dir: Path) -> dict[str, Tensor]:
    """List every tensor of a checkpoint (single file or sharded with an index) without loading any."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json; pass the folder of "
                              f"the official MOSS-TTS checkpoint (e.g. {download_command('OpenMOSS-Team/MOSS-TTS')})")
    tensors: dict[str, Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                tensors[name] = Tensor(name, path, view.get_dtype(), tuple(view.get_shape()))
    return tensors


def plan(tensors: dict[str, Tensor], n_vq: int) -> tuple[dict[str, Tensor], list[tuple[str, Tensor]]]:
    """Map source tensors to ``(npy, backbone)``: relative ``.npy`` path -> tensor, and ordered (Qwen3 key, tensor)
    pairs. ``CheckpointError`` when a tensor matches no rule, or a table or head is missing."""
    npy: dict[str, Tensor] = {}
    backbone: list[tuple[str, Tensor]] = []
    unknown = []
    for name in sorted(tensors):
        t = tensors[name]
        audio = re.fullmatch(r"emb_ext\.(\d+)\.weight", name)
        head = re.fullmatch(r"lm_heads\.(\d+)\.weight", name)
        if name == "language_model.embed_tokens.weight":
            npy["embeddings/embed_tokens.npy"] = t
        if audio:
            npy[f"embeddings/emb_ext_{int(audio.group(1)):02d}.npy"] = t
        elif head and int(head.group(1)) == 0:
            npy["lm_heads/lm_head_text.npy"] = t
            backbone.append(("lm_head.weight", t))  # the GGUF output head is the MOSS text head
        elif head:
            npy[f"lm_heads/lm_head_audio_{int(head.group(1)) - 1:02d}.npy"] = t
        elif name.startswith("language_model."):
            backbone.append(("model." + name[len("language_model."):], t))
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"tensors that match no conversion rule: {', '.join(unknown[:8])}"
                              f"{' ...' if len(unknown) > 8 else ''}; is this a MOSS-TTS Delay checkpoint?")
    wanted = (["embeddings/embed_tokens.npy", "lm_heads/lm_head_text.npy"]
              + [f"embeddings/emb_ext_{i:02d}.npy" for i in range(n_vq)]
              + [f"lm_heads/lm_head_audio_{i:02d}.npy" for i in range(n_vq)])
    missing = [w for w in wanted if w not in npy]
    if missing:
        raise CheckpointError(f"checkpoint lacks the tensors for {', '.join(missing[:6])}; n_vq={n_vq} in config.json")
    return npy, backbone


def _load(handles: ExitStack, opened: dict, t: Tensor):
    from safetensors import safe_open

    if t.file not in opened:
        opened[t.file] = handles.enter_context(safe_open(str(t.file), framework="pt"))
    return opened[t.file].get_tensor(t.name)


@contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; move it into place on success, delete it on any failure."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_npy(path: Path, tensor) -> None:
    """Save one tensor as a float16 ``.npy`` (atomic)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic(path) as tmp, open(tmp, "wb") as f:
        np.save(f, tensor.to(torch.float16).numpy(), allow_pickle=False)


def shard(entries: list[tuple[str, Tensor]], max_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Group entries in order into shards of at most ``max_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for key, t in entries:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += t.nbytes
    return shards if shards[0] else []


def write_safetensors(path: Path, entries: list[tuple[str, Tensor]], handles: ExitStack, opened: dict) -> None:
    """Write a safetensors file one tensor at a time (the ``safetensors`` library saves only whole dicts in memory):
    the same format, an 8-byte header length, the JSON header padded to 8 bytes, the raw little-endian data."""
    import torch

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in entries:
        header[key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with _atomic(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in entries:
            tensor = _load(handles, opened, t).contiguous().reshape(-1)
            f.write(tensor.view(torch.uint8).numpy().tobytes())


def backbone_config(moss: dict) -> dict:
    """Return the Qwen3ForCausalLM ``config.json`` for the backbone (the MOSS ``language_config``)."""
    lang = dict(moss.get("language_config") or {})
    if not lang:
        raise CheckpointError("config.json has no language_config; is this a MOSS-TTS Delay checkpoint?")
    lang.pop("_name_or_path", None)
    lang["architectures"] = ["Qwen3ForCausalLM"]
    lang["model_type"] = "qwen3"
    lang.setdefault("torch_dtype", "bfloat16")
    return lang


def convert(model_dir: Path | str, output_dir: Path | str, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Convert a checkpoint folder; return the output folder. ``CheckpointError`` for files missing, tensors unknown
    or missing, special ids absent from config.json; ``DeviceError`` when torch or safetensors is not installed."""
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401  (bf16 tensors are cast through torch)
    except Exception as exc:
        raise DeviceError(f"the converter reads the bf16 checkpoint with torch and safetensors ({exc}); install "
                          "them with `pip install -e \".[nano]\"` (a one-off: the converted weights need no torch)") from exc
    model_dir, out = Path(model_dir), Path(output_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} does not exist; pass the MOSS-TTS checkpoint folder")
    if not (model_dir / "tokenizer.json").is_file():  # checked before gigabytes are written
        raise CheckpointError(f"{model_dir} has no tokenizer.json; the Delay backend needs it")
    moss = json.loads(config_path.read_text(encoding="utf-8"))
    config = DelayModelConfig.from_dict(moss, str(config_path))
    tensors = read_index(model_dir)
    npy, backbone = plan(tensors, config.n_vq)
    qwen_dir = out / "qwen3_backbone"
    qwen_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as handles:
        opened: dict = {}
        for rel, t in npy.items():
            log.info("%s -> %s %s", t.name, rel, t.shape)
            write_npy(out / rel, _load(handles, opened, t))
        groups = shard(backbone, max_shard_bytes)
        names = (["model.safetensors"] if len(groups) == 1 else
                 [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
        for name, group in zip(names, groups):
            log.info("backbone shard %s (%d tensors)", name, len(group))
            write_safetensors(qwen_dir / name, group, handles, opened)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for _, t in backbone)},
                 "weight_map": {key: name for name, group in zip(names, groups) for key, _ in group}}
        write_json(qwen_dir / "model.safetensors.index.json", index)
    write_json(qwen_dir / "config.json", backbone_config(moss))
    for folder in (qwen_dir, out / "tokenizer"):
        folder.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, folder / name)
    write_json(out / "config.json", moss)
    text = tensors["language_model.embed_tokens.weight"].shape
    write_json(out / "extraction_meta.json", {
        "source_model": str(model_dir), "n_vq": config.n_vq, "hidden_size": text[1], "vocab_size": text[0],
        "audio_vocab_size": config.audio_vocab_size, "backbone_dir": "qwen3_backbone",
        "embedding_dir": "embeddings", "lm_head_dir": "lm_heads", "moss_config": moss})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """CLI under the moss_npu.cli policy. Exit codes: 0 converted, 1 conversion failed, 2 bad usage or input."""
    return run_cli(lambda: run(argv))


def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags and convert; print the output folder and the next step."""
    parser = ArgumentParser(
        prog="python -m moss_npu.delay.convert",
        description="Convert an official MOSS-TTS checkpoint into embeddings/, lm_heads/, tokenizer/ and a "
        "qwen3_backbone/ for llama.cpp's convert_hf_to_gguf.py. Exit codes: 0 ok, 1 failed, 2 bad usage/input.")
    parser.add_argument("--model", required=True, help="folder of the MOSS-TTS checkpoint (config.json + safetensors)")
    parser.add_argument("--output", required=True, help="folder to write the weights layout into")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s", stream=sys.stderr)
    out = convert(args.model, args.output)
    print(out)
    print(f"next: python convert_hf_to_gguf.py {out / 'qwen3_backbone'} --outtype f16 "
          f"--outfile {out / 'MOSS_TTS_F16.gguf'}  (llama.cpp checkout)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
