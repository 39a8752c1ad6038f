"""Text to a 48 kHz stereo WAV with MOSS-TTS-Nano on NPU, CUDA or CPU (or MOSS-TTS Delay through llama.cpp).

    python inference.py --device npu:0 --text "Hello" --output out.wav
    python inference.py --prompt-audio-path voice.wav --text-file story.txt --output story.wav --stream

Exit codes: 0 written; 1 runtime failure; 2 bad usage or input (nothing is written).
stdout carries only the result line; progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moss_npu.errors import InputError, MossNpuError, NumericalError

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (flags are the kebab-case names of the run settings)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text = p.add_argument_group("input and output")
    text.add_argument("--text", help="text to speak")
    text.add_argument("--text-file", help="UTF-8 file holding the text to speak")
    text.add_argument("--output", default="output.wav", help="WAV file to write (atomically)")
    text.add_argument("--prompt-audio-path", help="reference recording (wav/flac/mp3) of the voice to clone")
    text.add_argument("--prompt-text", help="transcript of the prompt audio (continuation mode)")
    text.add_argument("--mode", choices=("auto", "continuation", "voice_clone"),
                      help="auto (default): voice_clone when a reference is given without --prompt-text")
    text.add_argument("--stream", action="store_true", help="decode and write audio while it is generated")

    model = p.add_argument_group("model and device")
    model.add_argument("--backend", choices=("nano", "llama-cpp"), default="nano")
    model.add_argument("--impl", choices=("native", "upstream"), default="native",
                       help="upstream: run the official remote code with the NPU patch set")
    model.add_argument("--upstream-code", help="--impl upstream: folder holding the official *.py remote code "
                       "(default: the model folders themselves, as a hub download has them)")
    model.add_argument("--model", default="OpenMOSS-Team/MOSS-TTS-Nano", help="TTS folder or hub id")
    model.add_argument("--codec", default="OpenMOSS-Team/MOSS-Audio-Tokenizer-Nano", help="codec folder or hub id")
    model.add_argument("--config", help="YAML preset (configs/cpu.yaml, cuda.yaml, npu.yaml; llama_cpp/*.yaml)")
    model.add_argument("--device", help="auto (default), cpu, cuda[:N], npu[:N], mps")
    model.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    model.add_argument("--attn-implementation", choices=("sdpa", "eager"))

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-frames", type=int, help="frame limit per chunk (12.5 frames per second)")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    gen.add_argument("--host-rng", action="store_true", help="draw random numbers on the host (device-independent)")
    gen.add_argument("--nq", type=int, help="codebooks to generate (1..16)")
    gen.add_argument("--voice-clone-max-text-tokens", type=int, help="token budget of one long-text chunk")
    gen.add_argument("--tts-max-batch-size", type=int, help="most chunks generated at once (0 = memory-sized)")
    gen.add_argument("--speed", choices=("optimized", "reference"),
                     help="optimized (default: the frame decoder) or reference: the official algorithm, same codes up to rounding")
    gen.add_argument("--num-threads", type=int, help="intra-op CPU threads (on a busy 2-core machine, 1 is fastest)")
    gen.add_argument("--graph", choices=("auto", "on", "off"),
                     help="device graphs of the frame step (auto: on for CUDA/NPU with --host-rng, off on CPU)")
    for kind in ("text", "audio"):
        gen.add_argument(f"--{kind}-temperature", type=float)
        gen.add_argument(f"--{kind}-top-p", type=float)
        gen.add_argument(f"--{kind}-top-k", type=int)
    gen.add_argument("--audio-repetition-penalty", type=float)
    for name in SAMPLING_FLAGS:  # official infer.py's legacy flags: fill text and audio values left unset
        gen.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else float)

    delay = p.add_argument_group("llama-cpp backend (MOSS-TTS Delay)")
    delay.add_argument("--weights", help="folder with the GGUF backbone, embeddings/, lm_heads/, tokenizer/")
    delay.add_argument("--codec-onnx-dir", help="folder with encoder.onnx and decoder.onnx")

    p.add_argument("--quiet", action="store_true", help="no progress bar or info lines")
    p.add_argument("--verbose", action="store_true", help="let native libraries print")
    return p


def read_text(args: argparse.Namespace) -> str:
    """Return the text to speak from --text or --text-file."""
    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            raise InputError(f"--text-file {path}: file not found; pass an existing UTF-8 text file")
        text = path.read_text(encoding="utf-8")
    elif args.text is not None:
        text = args.text
    else:
        raise InputError("no text given; pass --text \"...\" or --text-file FILE")
    if not text.strip():
        raise InputError("the text is empty or whitespace; pass the words to speak")
    return text


def check_output(path: str) -> Path:
    """Fail early (before loading models) when the output cannot be written."""
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"--output {out}: folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise InputError(f"--output {out}: folder {folder} is not writable; choose a writable path")
    if out.is_dir():
        raise InputError(f"--output {out}: is a folder; give a file name such as {out / 'out.wav'}")
    return out


def run_overrides(args: argparse.Namespace) -> dict:
    """Return the run settings set explicitly on the command line (None = not set)."""
    values = {
        "device": args.device, "dtype": args.dtype, "attn_implementation": args.attn_implementation,
        "mode": args.mode, "max_new_frames": args.max_new_frames, "seed": args.seed, "nq": args.nq,
        "voice_clone_max_text_tokens": args.voice_clone_max_text_tokens,
        "tts_max_batch_size": args.tts_max_batch_size,
        "do_sample": False if args.greedy else None, "host_rng": True if args.host_rng else None,
        "graph": args.graph, "speed": args.speed, "num_threads": args.num_threads,
        "audio_repetition_penalty": args.audio_repetition_penalty,
    }
    for kind in ("text", "audio"):
        for name in ("temperature", "top_p", "top_k"):
            values[f"{kind}_{name}"] = getattr(args, f"{kind}_{name}")
    for name in SAMPLING_FLAGS:
        legacy = getattr(args, name)
        targets = ["audio_repetition_penalty"] if name == "repetition_penalty" else [f"text_{name}", f"audio_{name}"]
        for target in targets:
            if values.get(target) is None:
                values[target] = legacy
    return values


@dataclass(frozen=True)
class Outcome:
    """What the result line reports: audio length, synthesis time (models already loaded), first-audio time."""

    audio_s: float
    elapsed_s: float
    first_audio_s: Optional[float] = None


def synthesize_nano(args: argparse.Namespace, text: str, out: Path, progress: bool) -> Outcome:
    """Run the native (or upstream) Nano pipeline and write ``out``."""
    import torch

    from moss_npu import device as devices
    from moss_npu.audio import StreamingWavWriter, write_wav
    from moss_npu.tts import MossTTSNano
    from moss_npu.tts.settings import load_preset, merge

    settings = merge(load_preset(args.config) if args.config else None, run_overrides(args))
    dev = devices.resolve_device(settings.device)
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)  # a process-wide setting: the CLI's to make, not the library's
    if args.prompt_audio_path and not Path(args.prompt_audio_path).is_file():
        raise InputError(f"--prompt-audio-path {args.prompt_audio_path}: file not found; pass a wav/flac/mp3 recording")
    if args.impl == "upstream":
        return _synthesize_upstream(args, settings, dev, text, out)
    tts = MossTTSNano.from_pretrained(args.model, args.codec, device=str(dev), dtype=settings.dtype,
                                      attn_implementation=settings.attn_implementation)
    request = dict(prompt_audio=args.prompt_audio_path, prompt_text=args.prompt_text, settings=settings)
    bar = _progress_bar(progress)
    start = time.perf_counter()
    if not args.stream:
        result = tts.synthesize(text, on_frame=lambda chunk, frame: bar.update(1) if bar else None, **request)
        if bar:
            bar.close()
        elapsed = time.perf_counter() - start
        write_wav(out, result.waveform, result.sample_rate)
        return Outcome(result.waveform.shape[-1] / result.sample_rate, elapsed)
    first = None
    with StreamingWavWriter(out, tts.sample_rate, tts.codec.channels) as writer:
        for chunk in tts.synthesize_stream(text, **request):
            first = time.perf_counter() - start if first is None else first
            writer.write(chunk.waveform)
            if bar:
                bar.update(chunk.waveform.shape[-1] // tts.codec.frame_size)
        samples = writer.samples_written
        elapsed = time.perf_counter() - start
    if bar:
        bar.close()
    return Outcome(samples / tts.sample_rate, elapsed, first)


def _synthesize_upstream(args, settings, dev, text: str, out: Path) -> Outcome:
    from moss_npu import device as devices
    from moss_npu.audio import write_wav
    from moss_npu.upstream import load_upstream

    dtype = devices.resolve_dtype(dev, settings.dtype)
    mode = settings.mode
    if mode == "auto":
        mode = "voice_clone" if args.prompt_audio_path and not args.prompt_text else "continuation"
    params = dataclasses.asdict(settings.sampling()) | {
        "max_new_frames": settings.max_new_frames, "nq": settings.nq,
        "voice_clone_max_text_tokens": settings.voice_clone_max_text_tokens,
        "voice_clone_max_memory_per_sample_gb": settings.voice_clone_max_memory_per_sample_gb,
        "tts_max_batch_size": settings.tts_max_batch_size,
    }
    with load_upstream(args.model, args.codec, device=dev, dtype=dtype, code_dir=args.upstream_code,
                       attn_implementation=args.attn_implementation) as tts:
        start = time.perf_counter()
        wave, rate = tts.synthesize(text, mode=mode, prompt_audio_path=args.prompt_audio_path,
                                    prompt_text=args.prompt_text, seed=settings.seed, **params)
        elapsed = time.perf_counter() - start
    write_wav(out, wave, rate)
    return Outcome(wave.shape[-1] / rate, elapsed)


def synthesize_delay(args: argparse.Namespace, text: str, out: Path) -> Outcome:
    """Run the MOSS-TTS Delay fallback through llama.cpp and write ``out``."""
    import torch

    from moss_npu.audio import write_wav
    from moss_npu.delay.pipeline import DelayPipeline

    if not args.weights:
        raise InputError("--backend llama-cpp needs --weights DIR (the MOSS-TTS-GGUF folder)")
    if not args.codec_onnx_dir:
        raise InputError("--backend llama-cpp needs --codec-onnx-dir DIR (encoder.onnx + decoder.onnx)")
    overrides = {"verbose": True if args.verbose else None}
    with DelayPipeline.from_config(args.config, args.weights, args.codec_onnx_dir, overrides) as pipe:
        start = time.perf_counter()
        wave, rate = pipe.synthesize(text, args.prompt_audio_path, seed=args.seed)
        elapsed = time.perf_counter() - start
    write_wav(out, torch.from_numpy(wave), rate)
    return Outcome(wave.shape[-1] / rate, elapsed)


def _progress_bar(enabled: bool):
    """Return a tqdm counter of generated frames on stderr, or None when progress is off."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=None, unit="frame", file=sys.stderr, leave=False, dynamic_ncols=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Parse flags, synthesize, write the WAV and print one result line."""
    args = build_parser().parse_args(argv)
    try:
        text = read_text(args)
        out = check_output(args.output)
        progress = not args.quiet and sys.stderr.isatty()
        if args.backend == "llama-cpp":
            outcome = synthesize_delay(args, text, out)
        else:
            outcome = synthesize_nano(args, text, out, progress)
    except MossNpuError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NumericalError) else 2  # a run that went numerically wrong is not bad input
    rtf = outcome.elapsed_s / outcome.audio_s if outcome.audio_s > 0 else float("inf")
    line = f"wrote {out}: {outcome.audio_s:.2f} s of audio in {outcome.elapsed_s:.2f} s (RTF {rtf:.2f})"
    if outcome.first_audio_s is not None:
        line += f", first audio after {outcome.first_audio_s * 1000:.0f} ms"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
