"""Text to 48 kHz stereo audio with MOSS-TTS-Nano on NPU, CUDA or CPU (or MOSS-TTS Delay through llama.cpp).

    python inference.py --device npu:0 --text "Hello" --output out.wav
    python inference.py --prompt-audio-path voice.wav --text-file story.txt --output story.flac --stream

The output format follows the extension: .wav (float32; --wav-subtype PCM_16 for old players), .flac, .ogg,
.opus, .mp3. Only regular files are written, atomically: nothing appears unless the run succeeds.

Exit codes: 0 written; 1 runtime failure (the run failed on valid input); 2 bad usage or input (checked
before any model loads where possible); 130 interrupted (Ctrl-C, SIGTERM, SIGHUP). stdout carries only the
result line; progress, warnings and the one error line go to stderr. MOSS_NPU_DEBUG=1 adds tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from moss_npu.cli import ArgumentParser, configure_logging, device_spec, finite_float, int_in, run_cli, warn
from moss_npu.errors import GenerationError, InputError
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL
from moss_npu.output import WAV_SUBTYPES, AudioTarget, AtomicAudioWriter, audio_target
from moss_npu.tts.settings import MAX_NEW_FRAMES, MAX_SEED, load_preset, merge

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty")
NO_AUDIO = "the model stopped before any audio; try another --seed"


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (flags are the kebab-case names of the run settings)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text = p.add_argument_group("input and output")
    source = text.add_mutually_exclusive_group()
    source.add_argument("--text", help="text to speak")
    source.add_argument("--text-file", help="UTF-8 file holding the text to speak")
    text.add_argument("--output", default="output.wav",
                      help="audio file to write atomically: .wav (default output.wav), .flac, .ogg, .opus, .mp3")
    text.add_argument("--wav-subtype", choices=WAV_SUBTYPES,
                      help="sample format of .wav output (default FLOAT, unclipped; PCM_16 for old players)")
    text.add_argument("--prompt-audio-path", help="reference recording (wav/flac/mp3) of the voice to clone")
    text.add_argument("--prompt-text", help="transcript of the prompt audio (continuation mode)")
    text.add_argument("--mode", choices=("auto", "continuation", "voice_clone"),
                      help="auto (default): voice_clone when a reference is given without --prompt-text")
    text.add_argument("--stream", action="store_true", help="decode and write audio while it is generated")
    text.add_argument("--no-text-normalization", action="store_true",
                      help="read the text as given (no robust cleanup, no WeTextProcessing)")
    text.add_argument("--no-wetext", action="store_true",
                      help="robust cleanup only: numbers and symbols stay as written")
    text.add_argument("--print-normalized", action="store_true", help="print the text the model will read (stderr)")

    model = p.add_argument_group("model and device")
    model.add_argument("--backend", choices=("nano", "llama-cpp"), default="nano")
    model.add_argument("--impl", choices=("native", "upstream"), default="native",
                       help="upstream: run the official remote code with the NPU patch set")
    model.add_argument("--upstream-code", help="--impl upstream: folder holding the official *.py remote code "
                       "(default: the model folders themselves, as a hub download has them)")
    model.add_argument("--model", help=f"TTS folder or hub id (default {DEFAULT_MODEL})")
    model.add_argument("--codec", help=f"codec folder or hub id (default {DEFAULT_CODEC})")
    model.add_argument("--config", help="YAML preset (configs/cpu.yaml, cuda.yaml, npu.yaml; llama_cpp/*.yaml)")
    model.add_argument("--device", type=device_spec, help="auto (default), cpu, cuda[:N], npu[:N], mps")
    model.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    model.add_argument("--attn-implementation", choices=("sdpa", "eager"))

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-frames", type=int_in(1, MAX_NEW_FRAMES),
                     help=f"frame limit per text chunk, 12.5 frames per second (default 375; at most {MAX_NEW_FRAMES})")
    gen.add_argument("--seed", type=int_in(0, MAX_SEED), help="random seed, 0 .. 2**63-1")
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    gen.add_argument("--host-rng", action="store_true", help="draw random numbers on the host (device-independent)")
    gen.add_argument("--nq", type=int, help="codebooks to generate (1..16)")
    gen.add_argument("--voice-clone-max-text-tokens", type=int, help="token budget of one long-text chunk")
    gen.add_argument("--tts-max-batch-size", type=int, help="most chunks generated at once (0 = memory-sized)")
    gen.add_argument("--speed", choices=("optimized", "reference"),
                     help="optimized (default: the frame decoder) or reference: the official algorithm, same codes up to rounding")
    gen.add_argument("--num-threads", type=int_in(0, 4096),
                     help="intra-op CPU threads (on a busy 2-core machine, 1 is fastest)")
    gen.add_argument("--graph", choices=("auto", "on", "off"),
                     help="device graphs of the frame step (auto: on for CUDA/NPU with --host-rng, off on CPU)")
    for kind in ("text", "audio"):
        gen.add_argument(f"--{kind}-temperature", type=finite_float)
        gen.add_argument(f"--{kind}-top-p", type=finite_float)
        gen.add_argument(f"--{kind}-top-k", type=int)
    gen.add_argument("--audio-repetition-penalty", type=finite_float)
    for name in SAMPLING_FLAGS:  # official infer.py's legacy flags: fill text and audio values left unset
        gen.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else finite_float)

    delay = p.add_argument_group("llama-cpp backend (MOSS-TTS Delay)")
    delay.add_argument("--weights", help="folder with the GGUF backbone, embeddings/, lm_heads/, tokenizer/")
    delay.add_argument("--codec-onnx-dir", help="folder with encoder.onnx and decoder.onnx")

    p.add_argument("--quiet", action="store_true", help="no progress or info lines")
    p.add_argument("--verbose", action="store_true", help="info lines; let native libraries print")
    return p


# --- flags that act on one backend or implementation only -------------------------------------------------

# flag -> argparse dest, for flags that only the native Nano pipeline reads
NANO_ONLY = {"--stream": "stream", "--dtype": "dtype", "--attn-implementation": "attn_implementation",
             "--mode": "mode", "--prompt-text": "prompt_text", "--host-rng": "host_rng", "--nq": "nq",
             "--voice-clone-max-text-tokens": "voice_clone_max_text_tokens",
             "--tts-max-batch-size": "tts_max_batch_size", "--speed": "speed",
             "--graph": "graph", "--impl": "impl", "--upstream-code": "upstream_code",
             "--model": "model", "--codec": "codec"}
NOT_UPSTREAM = {"--stream": "stream", "--host-rng": "host_rng", "--speed": "speed", "--graph": "graph"}
LLAMA_CPP_ONLY = {"--weights": "weights", "--codec-onnx-dir": "codec_onnx_dir"}


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value not in (None, False) and not (dest == "impl" and value == "native")


def refuse_unused_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, any flag the chosen backend or implementation would silently ignore."""
    if args.backend == "llama-cpp":
        unused, where = NANO_ONLY, "--backend llama-cpp"
    elif args.impl == "upstream":
        unused, where = {**NOT_UPSTREAM, **LLAMA_CPP_ONLY}, "--impl upstream"
    else:
        unused, where = {**LLAMA_CPP_ONLY, "--upstream-code": "upstream_code"}, "--backend nano --impl native"
    given = [flag for flag, dest in unused.items() if _given(args, dest)]
    if given:
        raise InputError(f"{', '.join(given)}: not used by {where}; drop {'it' if len(given) == 1 else 'them'} "
                         "(see python inference.py --help)")


def llama_cpp_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Map the generic flags onto the llama-cpp backend's preset keys (None = keep the preset's value).

    ``--greedy`` is temperature 0 on both heads; ``--device cpu`` keeps every layer, the audio heads and the
    ONNX codec on the CPU, another kind offloads all layers and runs the heads and codec there;
    ``--num-threads`` sets llama.cpp's threads. ``--max-new-frames`` is applied per call (see
    ``llama_cpp_max_new_tokens``). Flags with no counterpart are refused by ``refuse_unused_flags``.
    """
    values = run_overrides(args)
    keys = ("text_temperature", "text_top_p", "text_top_k", "audio_temperature", "audio_top_p", "audio_top_k",
            "audio_repetition_penalty")
    out: dict[str, Any] = {key: values[key] for key in keys}
    for key in ("text_temperature", "audio_temperature"):
        if out[key] is not None and out[key] <= 0:
            raise InputError(f"--{key.replace('_', '-')} {out[key]}: must be > 0; use --greedy for argmax decoding")
    if args.greedy:
        out.update(text_temperature=0.0, audio_temperature=0.0)
    if args.num_threads:
        out["n_threads"] = args.num_threads
    if args.device and args.device != "auto":
        kind, _, index = args.device.partition(":")
        if index not in ("", "0"):
            raise InputError(f"--device {args.device}: --backend llama-cpp offloads to the first visible device; "
                             f"pass --device {kind} and choose the device with its visible-devices variable")
        if kind == "cpu":
            out.update(n_gpu_layers=0, heads_device="cpu", audio_provider="cpu")
        else:
            out.update(n_gpu_layers=-1, heads_device=args.device, audio_provider=kind)
    out["verbose"] = True if args.verbose else None
    return out


def llama_cpp_max_new_tokens(args: argparse.Namespace, n_vq: int) -> Optional[int]:
    """``--max-new-frames N`` as Delay steps: N frames plus the ``n_vq``-step delay tail (None = the preset's)."""
    return None if args.max_new_frames is None else args.max_new_frames + n_vq


# --- inputs ------------------------------------------------------------------------------------------------

def read_text(args: argparse.Namespace) -> str:
    """Return the text to speak from --text or --text-file (UTF-8, a byte-order mark allowed)."""
    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "file not found"
            raise InputError(f"--text-file {path}: {what}; pass an existing UTF-8 text file")
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError(f"--text-file {path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                             f"{exc.start}); save it as UTF-8") from None
        except OSError as exc:
            raise InputError(f"--text-file {path}: cannot read ({exc.strerror}); check the file") from None
        if "\x00" in text:
            raise InputError(f"--text-file {path}: holds NUL bytes (a binary file?); pass a UTF-8 text file")
    elif args.text is not None:
        text = args.text
    else:
        raise InputError("no text given; pass --text \"...\" or --text-file FILE")
    if not text.strip():
        raise InputError("the text is empty or whitespace; pass the words to speak")
    return text


def warn_if_unspeakable(text: str) -> None:
    """Warn when the text holds no letter or digit in any script (only punctuation, symbols or emoji)."""
    if not any(ch.isalnum() for ch in text):
        warn("the text has no letters or digits (only punctuation, symbols or emoji); the audio may be noise "
             "or silence")


def refuse_output_over_input(args: argparse.Namespace, target: AudioTarget) -> None:
    """Refuse an --output that would replace one of the run's own input files."""
    for flag in ("text_file", "prompt_audio_path", "config"):
        value = getattr(args, flag, None)
        if value and os.path.realpath(value) == str(target.real_path):
            raise InputError(f"--output {target.path}: is the --{flag.replace('_', '-')} file; choose another path")


def run_overrides(args: argparse.Namespace) -> dict:
    """Return the run settings set explicitly on the command line (None = not set)."""
    values = {
        "device": args.device, "dtype": args.dtype, "attn_implementation": args.attn_implementation,
        "mode": args.mode, "max_new_frames": args.max_new_frames, "seed": args.seed, "nq": args.nq,
        "voice_clone_max_text_tokens": args.voice_clone_max_text_tokens,
        "tts_max_batch_size": args.tts_max_batch_size,
        "do_sample": False if args.greedy else None, "host_rng": True if args.host_rng else None,
        "graph": args.graph, "speed": args.speed, "num_threads": args.num_threads,
        "text_normalization": False if args.no_text_normalization else None,
        "wetext": False if args.no_text_normalization or args.no_wetext else None,
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


# --- synthesis ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What the result line reports: audio length, synthesis time (models already loaded), first-audio time."""

    audio_s: float
    elapsed_s: float
    first_audio_s: Optional[float] = None


def synthesize_nano(args: argparse.Namespace, text: str, target: AudioTarget) -> Outcome:
    """Run the native (or upstream) Nano pipeline and write ``target``."""
    import torch

    from moss_npu import device as devices
    from moss_npu.output import save_audio
    from moss_npu.text import TextNormalizer
    from moss_npu.tts import MossTTSNano

    load, settings = merge(load_preset(args.config) if args.config else None, run_overrides(args))
    dev = devices.resolve_device(load.device)
    if load.num_threads > 0:
        torch.set_num_threads(load.num_threads)  # a process-wide setting: the CLI's to make, not the library's
    if args.prompt_audio_path and not Path(args.prompt_audio_path).is_file():
        raise InputError(f"--prompt-audio-path {args.prompt_audio_path}: file not found; pass a wav/flac/mp3 recording")
    model, codec = args.model or DEFAULT_MODEL, args.codec or DEFAULT_CODEC
    if args.impl == "upstream":  # infer.py prepares the texts before the official model code sees them
        prepared = _print_normalized(args, TextNormalizer(), text, settings)
        args.prompt_text = None if args.prompt_text is None else prepared.prompt_text
        return _synthesize_upstream(args, load, settings, dev, prepared.text, target, model, codec)
    tts = MossTTSNano.from_pretrained(model, codec, device=str(dev), dtype=load.dtype,
                                      attn_implementation=load.attn_implementation)
    target.check_rate(tts.sample_rate)
    request = dict(prompt_audio=args.prompt_audio_path, prompt_text=args.prompt_text, settings=settings)
    if args.print_normalized:
        _print_normalized(args, tts.normalizer, text, settings)
    progress = _progress(args, tts.codec.frame_rate_hz)
    start = time.perf_counter()
    if not args.stream:
        with progress:
            result = tts.synthesize(text, on_frame=progress.on_frame, **request)
        elapsed = time.perf_counter() - start
        if result.codes.shape[0] == 0:
            raise GenerationError(NO_AUDIO)
        _warn_at_cap(progress, settings.max_new_frames)
        save_audio(target.path, result.waveform, result.sample_rate, target=target)
        return Outcome(result.waveform.shape[-1] / result.sample_rate, elapsed)
    first = None
    with AtomicAudioWriter(target, tts.sample_rate, tts.codec.channels) as writer, progress:
        for chunk in tts.synthesize_stream(text, **request):
            first = time.perf_counter() - start if first is None else first
            writer.write(chunk.waveform)
            if not chunk.is_pause:
                progress.add_frames(chunk.chunk_index, chunk.waveform.shape[-1] // tts.codec.frame_size)
        if progress.total_frames == 0:
            raise GenerationError(NO_AUDIO)  # leaving the block removes the temp file
        samples = writer.samples_written
        elapsed = time.perf_counter() - start
    _warn_at_cap(progress, settings.max_new_frames)
    return Outcome(samples / tts.sample_rate, elapsed, first)


def _progress(args: argparse.Namespace, frame_rate_hz: float):
    from moss_npu.progress import Progress, pick_display

    return Progress(pick_display(args.quiet), frame_rate_hz)


def _warn_at_cap(progress, max_new_frames: int) -> None:
    """Warn about text chunks whose generation stopped at the frame cap: their audio may be cut off."""
    capped = progress.chunks_at_cap(max_new_frames)
    if capped:
        which = "the text" if progress.frames.keys() == {0} else \
            f"chunk{'s' if len(capped) > 1 else ''} {', '.join(str(c + 1) for c in capped)}"
        warn(f"{which} reached --max-new-frames {max_new_frames} ({max_new_frames / progress.frame_rate_hz:.1f} s) "
             "before the model finished; the audio may be cut off; raise --max-new-frames")


def _print_normalized(args: argparse.Namespace, normalizer, text: str, settings):
    """Prepare the texts as the pipeline does; print them to stderr with --print-normalized."""
    prepared = normalizer.prepare(text, args.prompt_text or "", robust=settings.text_normalization,
                                  wetext=settings.wetext)
    if args.print_normalized:
        print(f"normalized ({prepared.method}): {prepared.text}", file=sys.stderr)
        if args.prompt_text is not None:
            print(f"normalized prompt text: {prepared.prompt_text}", file=sys.stderr)
    return prepared


def _synthesize_upstream(args, load, settings, dev, text: str, target: AudioTarget, model: str,
                         codec: str) -> Outcome:
    from moss_npu import device as devices
    from moss_npu.output import save_audio
    from moss_npu.upstream import load_upstream

    dtype = devices.resolve_dtype(dev, load.dtype)
    mode = settings.mode
    if mode == "auto":
        mode = "voice_clone" if args.prompt_audio_path and not args.prompt_text else "continuation"
    params = dataclasses.asdict(settings.sampling()) | {
        "max_new_frames": settings.max_new_frames, "nq": settings.nq,
        "voice_clone_max_text_tokens": settings.voice_clone_max_text_tokens,
        "voice_clone_max_memory_per_sample_gb": settings.voice_clone_max_memory_per_sample_gb,
        "tts_max_batch_size": settings.tts_max_batch_size,
    }
    with load_upstream(model, codec, device=dev, dtype=dtype, code_dir=args.upstream_code,
                       attn_implementation=args.attn_implementation) as tts:
        start = time.perf_counter()
        wave, rate = tts.synthesize(text, mode=mode, prompt_audio_path=args.prompt_audio_path,
                                    prompt_text=args.prompt_text, seed=settings.seed, **params)
        elapsed = time.perf_counter() - start
    if wave.shape[-1] == 0:
        raise GenerationError(NO_AUDIO)
    save_audio(target.path, wave, rate, target=target)
    return Outcome(wave.shape[-1] / rate, elapsed)


def synthesize_delay(args: argparse.Namespace, text: str, target: AudioTarget) -> Outcome:
    """Run the MOSS-TTS Delay fallback through llama.cpp and write ``target``."""
    import torch

    from moss_npu.delay.pipeline import DelayPipeline
    from moss_npu.output import save_audio

    if args.no_text_normalization or args.no_wetext or args.print_normalized:
        raise InputError("--no-text-normalization, --no-wetext and --print-normalized apply to --backend nano only")
    if not args.weights:
        raise InputError("--backend llama-cpp needs --weights DIR (the MOSS-TTS-GGUF folder)")
    if not args.codec_onnx_dir:
        raise InputError("--backend llama-cpp needs --codec-onnx-dir DIR (encoder.onnx + decoder.onnx)")
    overrides = llama_cpp_overrides(args)
    with DelayPipeline.from_config(args.config, args.weights, args.codec_onnx_dir, overrides) as pipe:
        start = time.perf_counter()
        wave, rate = pipe.synthesize(text, args.prompt_audio_path, seed=args.seed,
                                     max_new_tokens=llama_cpp_max_new_tokens(args, pipe.config.n_vq))
        elapsed = time.perf_counter() - start
    save_audio(target.path, torch.from_numpy(wave), rate, target=target)
    return Outcome(wave.shape[-1] / rate, elapsed)


# --- entry point -------------------------------------------------------------------------------------------

def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags, check every input and the output path, synthesize, write, print one result line."""
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    refuse_unused_flags(args)
    text = read_text(args)
    target = audio_target(args.output, args.wav_subtype)
    refuse_output_over_input(args, target)
    warn_if_unspeakable(text)
    if args.backend == "llama-cpp":
        outcome = synthesize_delay(args, text, target)
    else:
        outcome = synthesize_nano(args, text, target)
    rtf = outcome.elapsed_s / outcome.audio_s if outcome.audio_s > 0 else float("inf")
    line = f"wrote {target.path}: {outcome.audio_s:.2f} s of audio in {outcome.elapsed_s:.2f} s (RTF {rtf:.2f})"
    if outcome.first_audio_s is not None:
        line += f", first audio after {outcome.first_audio_s * 1000:.0f} ms"
    print(line, flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``run`` under the exit-code policy: one ``error:`` line and the error class's exit code on failure."""
    return run_cli(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
