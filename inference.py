"""Text to 48 kHz stereo audio with MOSS-TTS-Nano on NPU, CUDA or CPU (or MOSS-TTS Delay through llama.cpp).

    python inference.py --device npu:0 --text "Hello" --output out.wav
    python inference.py --prompt-audio-path voice.wav --text-file story.txt --output story.flac --stream
    python inference.py --backend llama-cpp --weights DIR --codec-onnx-dir DIR --text "Hello"   # Delay, no torch

The output format follows the extension: .wav (float32; --wav-subtype PCM_16 for old players), .flac, .ogg,
.opus, .mp3. Only regular files are written, atomically: nothing appears unless the run succeeds.

Exit codes: 0 written; 1 runtime failure (the run failed on valid input); 2 bad usage or input (checked
before any model loads where possible); 130 interrupted (Ctrl-C, SIGTERM, SIGHUP). stdout carries only the
result line; progress, warnings and the one error line go to stderr. MOSS_NPU_DEBUG=1 adds tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from moss_npu.cli import (ArgumentParser, check_utf8_text, configure_logging, device_problem, device_spec,
                          finite_float, int_in, process_seconds, read_utf8, run_cli, warn)
from moss_npu.errors import DeviceError, GenerationError, InputError, SettingError
from moss_npu.extras import LLAMA_INSTALL as DELAY_INSTALL
from moss_npu.extras import NANO_INSTALL
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL
from moss_npu.limits import MAX_NEW_FRAMES, MAX_SEED
from moss_npu.sampling_params import VALUES as SAMPLING_VALUES
from moss_npu.output import (WAV_SUBTYPES, AtomicAudioWriter, AudioTarget, audio_target, refuse_own_inputs,
                             writable_file, write_json)
from moss_npu.tempo import MAX_SPEED, MIN_SPEED, check_speed
from moss_npu.wavfile import probe

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty")
NO_AUDIO = "the model stopped before any audio; try another --seed"
BACKENDS = ("auto", "nano", "llama-cpp")
DELAY_ONLY_FLAGS = ("weights", "codec_onnx_dir")
BACKEND_NAMES = {"nano": "nano (MOSS-TTS-Nano)", "llama-cpp": "llama-cpp (MOSS-TTS Delay)"}
DECODERS = ("optimized", "reference")


def speaking_rate(text: str) -> float:
    """argparse type of ``--speed``: a rate in 0.25 .. 4.0."""
    value = finite_float(text)
    try:
        check_speed(value)
    except SettingError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (flags are the kebab-case names of the run settings)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text = p.add_argument_group("input and output")
    source = text.add_mutually_exclusive_group()
    source.add_argument("--text", help="text to speak")
    source.add_argument("--text-file", help="UTF-8 file holding the text to speak (- reads stdin)")
    text.add_argument("--output", default="output.wav",
                      help="audio file to write atomically: .wav (default output.wav), .flac, .ogg, .opus, .mp3")
    text.add_argument("--wav-subtype", choices=WAV_SUBTYPES,
                      help="sample format of .wav output (default FLOAT, unclipped; PCM_16 for old players)")
    text.add_argument("--prompt-audio-path", help="reference recording (wav/flac/mp3) of the voice to clone")
    text.add_argument("--prompt-text", help="transcript of the prompt audio (continuation mode)")
    text.add_argument("--mode", choices=("auto", "continuation", "voice_clone"),
                      help="auto (default): voice_clone when a reference is given without --prompt-text")
    text.add_argument("--stream", action="store_true", help="decode and write audio while it is generated")
    text.add_argument("--timestamps", metavar="FILE.json",
                      help="also write each text chunk's text and start/end second in the audio (speed included)")
    text.add_argument("--no-text-normalization", action="store_true",
                      help="read the text as given (no robust cleanup, no WeTextProcessing)")
    text.add_argument("--no-wetext", action="store_true",
                      help="robust cleanup only: numbers and symbols stay as written")
    text.add_argument("--print-normalized", action="store_true", help="print the text the model will read (stderr)")

    model = p.add_argument_group("model and device")
    model.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="auto (default): nano when torch imports, else llama-cpp (MOSS-TTS Delay) when --weights "
                       "is given; the result line names the backend that ran")
    model.add_argument("--impl", choices=("native", "upstream"), default="native",
                       help="upstream: run the official remote code with the NPU patch set")
    model.add_argument("--upstream-code", help="--impl upstream: folder holding the official *.py remote code "
                       "(default: the model folders themselves, as a hub download has them)")
    model.add_argument("--model", help=f"TTS folder or hub id (default {DEFAULT_MODEL})")
    model.add_argument("--codec", help=f"codec folder or hub id (default {DEFAULT_CODEC})")
    model.add_argument("--config", help="YAML preset (configs/cpu.yaml, cuda.yaml, npu.yaml; llama_cpp/*.yaml)")
    model.add_argument("--device", type=device_spec, help="auto (default), cpu, cuda[:N], npu[:N], mps")
    model.add_argument("--dtype", help="float32 (default), bfloat16 or float16 (on the CPU bfloat16 means bf16 "
                                       "weights, float32 arithmetic)")
    model.add_argument("--quantize", choices=("none", "int8"),
                       help="int8: the LM's block weights rounded to int8, decoded by an int8 kernel (CPU, float32)")
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
    gen.add_argument("--decoder", choices=DECODERS,
                     help="optimized (default: the frame decoder) or reference: the official algorithm, same codes up to rounding")
    gen.add_argument("--speed", type=speaking_rate,
                     help=f"speaking rate, pitch kept ({MIN_SPEED} .. {MAX_SPEED}; default 1.0: as the model speaks)")
    gen.add_argument("--num-threads", type=int_in(0, 4096),
                     help="intra-op CPU threads (default 0: one per core, one on 2 cores with the frames borrowing "
                          "the other while they run; N keeps the run to N)")
    gen.add_argument("--graph", choices=("auto", "on", "off"),
                     help="device graphs of the frame step (auto: on for CUDA/NPU with --host-rng, off on CPU)")
    gen.add_argument("--compile", choices=("auto", "on", "off"),
                     help="torch.compile the float32 CPU frame step (auto: eager, measured faster; see README)")
    for name in SAMPLING_VALUES:  # moss_npu.sampling_params: the same keys for Nano, Delay and the server
        gen.add_argument(f"--{name.replace('_', '-')}", type=int if name.endswith("top_k") else finite_float)
    for name in SAMPLING_FLAGS:  # official infer.py's legacy flags: fill text and audio values left unset
        gen.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else finite_float)

    delay = p.add_argument_group("llama-cpp backend (MOSS-TTS Delay)")
    delay.add_argument("--weights", help="folder with the GGUF backbone, embeddings/, lm_heads/, tokenizer/")
    delay.add_argument("--codec-onnx-dir", help="folder with encoder.onnx and decoder.onnx")

    p.add_argument("--quiet", action="store_true", help="no progress or info lines")
    p.add_argument("--verbose", action="store_true", help="info lines; let native libraries print")
    return p


# --- flags that act on one backend or implementation only -------------------------------------------------

# flag -> argparse dest (the llama-cpp backend refuses its own set: moss_npu.delay.flags)
NOT_UPSTREAM = {"--stream": "stream", "--host-rng": "host_rng", "--decoder": "decoder", "--speed": "speed", "--graph": "graph",
                "--compile": "compile", "--quantize": "quantize", "--timestamps": "timestamps"}
LLAMA_CPP_ONLY = {"--weights": "weights", "--codec-onnx-dir": "codec_onnx_dir"}
# argparse dests of the values that only shape a random draw (the repetition penalty acts on greedy runs too)
SAMPLING_ONLY = tuple(f"{kind}_{name}" for kind in ("text", "audio") for name in ("temperature", "top_p", "top_k")) + (
    "temperature", "top_p", "top_k")


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value not in (None, False) and not (dest == "impl" and value == "native")


def refuse_unused_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, any flag the Nano implementation chosen would silently ignore."""
    if args.impl == "upstream":
        unused, where = {**NOT_UPSTREAM, **LLAMA_CPP_ONLY}, "--impl upstream"
    else:
        unused, where = {**LLAMA_CPP_ONLY, "--upstream-code": "upstream_code"}, "--backend nano --impl native"
    given = [flag for flag, dest in unused.items() if _given(args, dest)]
    if given:
        raise InputError(f"{', '.join(given)}: not used by {where}; drop {'it' if len(given) == 1 else 'them'} "
                         "(see python inference.py --help)")
    drawn = [f"--{dest.replace('_', '-')}" for dest in SAMPLING_ONLY if getattr(args, dest) is not None]
    if args.greedy and drawn:
        raise InputError(f"{', '.join(drawn)}: not used with --greedy (argmax decoding); drop "
                         f"{'it' if len(drawn) == 1 else 'them'} or --greedy")


# --- inputs ------------------------------------------------------------------------------------------------

def read_text(args: argparse.Namespace) -> str:
    """Return the text to speak from --text or --text-file (UTF-8, a byte-order mark allowed; ``-`` is stdin)."""
    if args.text_file:
        path = Path(args.text_file)
        if args.text_file != "-" and not path.is_file():
            what = ("is a folder" if path.is_dir() else "is not a regular file" if path.exists()
                    else "file not found")
            raise InputError(f"--text-file {path}: {what}; pass an existing UTF-8 text file, or - for stdin")
        text = read_utf8(path, "--text-file")
    elif args.text is not None:
        text = args.text
    else:
        raise InputError("no text given; pass --text \"...\" or --text-file FILE")
    if not text.strip():
        raise InputError("the text is empty or whitespace; pass the words to speak")
    check_utf8_text(text, "--text-file" if args.text_file else "--text")
    return text


def check_reference(path: Optional[str]) -> None:
    """Refuse a --prompt-audio-path that is not an existing regular file, or whose header is not a recording
    within the limits (``moss_npu.wavfile.probe``: no sample is read), before any model loads."""
    if not path:
        return
    if not Path(path).is_file():
        what = ("is a folder" if Path(path).is_dir() else "is not a regular file" if Path(path).exists()
                else "file not found")
        raise InputError(f"--prompt-audio-path {path}: {what}; pass a wav/flac/mp3 recording")
    with open(path, "rb") as fh:
        probe(fh, f"--prompt-audio-path {path}")


def warn_if_unspeakable(text: str) -> None:
    """Warn when the text holds no letter or digit in any script (only punctuation, symbols or emoji)."""
    if not any(ch.isalnum() for ch in text):
        warn("the text has no letters or digits (only punctuation, symbols or emoji); the audio may be noise "
             "or silence")


def refuse_output_over_input(args: argparse.Namespace, target: AudioTarget) -> None:
    """Refuse an --output that would replace one of the run's own input files."""
    refuse_own_inputs(target.real_path, target.path, {f"--{name.replace('_', '-')}": getattr(args, name, None)
                                                      for name in ("text_file", "prompt_audio_path", "config")})


def timestamps_target(args: argparse.Namespace, target: AudioTarget) -> Optional[Path]:
    """Check ``--timestamps`` before anything runs: a writable .json file that is neither an input nor --output."""
    if args.timestamps is None:
        return None
    if Path(args.timestamps).suffix.lower() != ".json":
        raise InputError(f"--timestamps {args.timestamps}: give a .json file name")
    real = writable_file(args.timestamps, "--timestamps")
    inputs = {f"--{name.replace('_', '-')}": getattr(args, name, None)
              for name in ("text_file", "prompt_audio_path", "config")}
    refuse_own_inputs(real, args.timestamps, {**inputs, "--output": str(target.real_path)}, flag="--timestamps")
    return real


def run_overrides(args: argparse.Namespace) -> dict:
    """Return the run settings set explicitly on the command line (None = not set)."""
    values = {
        "device": args.device, "dtype": args.dtype, "attn_implementation": args.attn_implementation,
        "quantize": args.quantize,
        "mode": args.mode, "max_new_frames": args.max_new_frames, "seed": args.seed, "nq": args.nq,
        "voice_clone_max_text_tokens": args.voice_clone_max_text_tokens,
        "tts_max_batch_size": args.tts_max_batch_size,
        "do_sample": False if args.greedy else None, "host_rng": True if args.host_rng else None,
        "graph": args.graph, "compile": args.compile, "decoder": args.decoder, "speed": args.speed, "num_threads": args.num_threads,
        "text_normalization": False if args.no_text_normalization else None,
        "wetext": False if args.no_text_normalization or args.no_wetext else None,
        **{name: getattr(args, name) for name in SAMPLING_VALUES},
    }
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
    """What the result line reports: audio length, synthesis time (models already loaded), first-audio time since
    the synthesis started and since the process did (everything a user waits: imports, loading)."""

    audio_s: float
    elapsed_s: float
    first_audio_s: Optional[float] = None
    first_audio_process_s: Optional[float] = None
    timestamps: tuple = ()  # moss_npu.tts.timeline.Timestamp of each text chunk (Nano only)


def torch_imports() -> bool:
    """Return whether torch can be imported here (a broken build counts as absent).

    Raises:
        DeviceError: torch is installed but an installed device extension (torch_npu) broke its import.
    """
    from moss_npu.device import import_torch

    try:
        import_torch()
    except DeviceError:
        raise
    except Exception:  # a torch built for another CUDA can fail with OSError at import
        return False
    return True


def choose_backend(args: argparse.Namespace) -> str:
    """Resolve ``--backend``: ``auto`` is nano when torch imports, else llama-cpp when ``--weights`` is given.

    Raises:
        DeviceError: the chosen backend cannot run here; the message names the install command.
        InputError: ``auto`` picked nano while Delay-only flags were given (never switch models silently).
    """
    if args.backend == "llama-cpp":
        return "llama-cpp"
    has_torch = torch_imports()
    if args.backend == "nano" and not has_torch:
        raise DeviceError(f"--backend nano needs torch, which is not importable here; install it with "
                          f"`{NANO_INSTALL}` (install the torch build for your machine first, see README)")
    delay_flags = [f"--{name.replace('_', '-')}" for name in DELAY_ONLY_FLAGS if getattr(args, name)]
    if has_torch:
        if delay_flags:
            raise InputError(f"{' and '.join(delay_flags)} belong to the llama-cpp backend, but --backend "
                             f"{args.backend} runs nano (torch is installed); pass --backend llama-cpp for the Delay model")
        return "nano"
    if delay_flags:
        return "llama-cpp"
    raise DeviceError(f"no backend can run: torch is not importable (nano: `{NANO_INSTALL}`) and no --weights was "
                      f"given for the llama.cpp Delay fallback (`{DELAY_INSTALL}`, then --weights DIR --codec-onnx-dir DIR)")


def synthesize_nano(args: argparse.Namespace, text: str, target: AudioTarget) -> Outcome:
    """Run the native (or upstream) Nano pipeline and write ``target``."""
    from moss_npu import device as devices
    from moss_npu.output import save_audio
    from moss_npu.text import TextNormalizer
    from moss_npu.cpu.threads import set_threads
    from moss_npu.tts import MossTTSNano
    from moss_npu.tts.settings import load_preset, merge
    from moss_npu.tts.timeline import Timeline

    preset = load_preset(args.config) if args.config else {}
    load, settings = merge(preset, run_overrides(args))
    problem = device_problem(preset["device"]) if preset.get("device") else None  # checked even when --device wins
    if problem:
        raise InputError(f"--config {args.config} device {problem}")
    dev = devices.resolve_device(load.device)
    set_threads(load.num_threads)  # a process-wide setting (0: the policy of moss_npu.cpu.threads): the CLI's to make
    check_reference(args.prompt_audio_path)
    model, codec = args.model or DEFAULT_MODEL, args.codec or DEFAULT_CODEC
    if args.impl == "upstream":  # infer.py prepares the texts before the official model code sees them
        prepared = _print_normalized(args, TextNormalizer(), text, settings)
        args.prompt_text = None if args.prompt_text is None else prepared.prompt_text
        return _synthesize_upstream(args, load, settings, dev, prepared.text, target, model, codec)
    tts = MossTTSNano.from_pretrained(model, codec, device=str(dev), dtype=load.dtype,
                                      attn_implementation=load.attn_implementation, quantize=load.quantize,
                                      decoder=load.decoder, graph=load.graph, compile=load.compile,
                                      num_threads=load.num_threads)  # 0: its frames borrow the idle cores
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
        return Outcome(result.waveform.shape[-1] / result.sample_rate, elapsed, timestamps=result.timestamps)
    first, first_process, timeline, stamps = None, None, Timeline(tts.sample_rate, settings.speed), []
    with AtomicAudioWriter(target, tts.sample_rate, tts.codec.channels) as writer, progress:
        for chunk in tts.synthesize_stream(text, **request):
            if first is None:
                first, first_process = time.perf_counter() - start, process_seconds()
            writer.write(chunk.waveform)
            stamps += timeline.add(chunk.chunk_index, chunk.text, chunk.source_length)
            if not chunk.is_pause:
                progress.add_frames(chunk.chunk_index, chunk.source_length // tts.codec.frame_size)
        if progress.total_frames == 0:
            raise GenerationError(NO_AUDIO)  # leaving the block removes the temp file
        samples = writer.samples_written
        elapsed = time.perf_counter() - start
    _warn_at_cap(progress, settings.max_new_frames)
    return Outcome(samples / tts.sample_rate, elapsed, first, first_process, tuple(stamps + timeline.finish(samples)))


def _progress(args: argparse.Namespace, frame_rate_hz: Optional[float], unit: str = "frame"):
    from moss_npu.progress import Progress, pick_display

    return Progress(pick_display(args.quiet), frame_rate_hz, unit=unit)


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
        result = tts.infer(text, mode=mode, prompt_audio_path=args.prompt_audio_path, prompt_text=args.prompt_text,
                           seed=settings.seed, **params)
        wave, rate = result.waveform, result.sample_rate
        elapsed = time.perf_counter() - start
    if wave.shape[-1] == 0:
        raise GenerationError(NO_AUDIO)
    save_audio(target.path, wave, rate, target=target)
    return Outcome(wave.shape[-1] / rate, elapsed)


def synthesize_delay(args: argparse.Namespace, request, text: str, target: AudioTarget) -> Outcome:
    """Run the MOSS-TTS Delay fallback (``request``: its ``DelayRequest``) through llama.cpp and write ``target``
    (24 kHz mono); no torch needed."""
    from moss_npu.delay.pipeline import DelayPipeline
    from moss_npu.output import save_audio

    # Decoding steps, not audio: the first steps of the delay staircase complete no frame yet.
    progress = _progress(args, None, unit="step")
    with DelayPipeline.open(request.run, args.weights, args.codec_onnx_dir) as pipe, progress:
        start = time.perf_counter()
        wave, rate = pipe.synthesize(text, request.reference, seed=request.seed, max_new_frames=request.max_new_frames,
                                     on_step=lambda steps: progress.on_frame(0, steps - 1))
        elapsed = time.perf_counter() - start
    save_audio(target.path, wave, rate, target=target)
    return Outcome(wave.shape[-1] / rate, elapsed)


# --- entry point -------------------------------------------------------------------------------------------

def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags, check every input and the output path, synthesize, write, print one result line."""
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    backend = choose_backend(args)
    delay = None
    if backend == "llama-cpp":
        from moss_npu.delay.flags import delay_request

        delay = delay_request(args, vars(build_parser().parse_args([])))  # refuses what Delay cannot honour
    else:
        refuse_unused_flags(args)
    text = read_text(args)
    target = audio_target(args.output, args.wav_subtype)
    refuse_output_over_input(args, target)
    stamps_path = timestamps_target(args, target) if backend != "llama-cpp" else None
    check_reference(args.prompt_audio_path)
    warn_if_unspeakable(text)
    if backend == "llama-cpp":
        outcome = synthesize_delay(args, delay, text, target)
    else:
        outcome = synthesize_nano(args, text, target)
    if stamps_path is not None:
        write_json(stamps_path, {"audio_seconds": round(outcome.audio_s, 6),
                                 "chunks": [stamp.public() for stamp in outcome.timestamps]})
    rtf = outcome.elapsed_s / outcome.audio_s if outcome.audio_s > 0 else float("inf")
    line = f"wrote {target.path}: {outcome.audio_s:.2f} s of audio in {outcome.elapsed_s:.2f} s (RTF {rtf:.2f})"
    if outcome.first_audio_s is not None:
        line += f", first audio after {outcome.first_audio_s * 1000:.0f} ms"
        if outcome.first_audio_process_s is not None:
            line += f" ({outcome.first_audio_process_s:.2f} s after the process started)"
    print(f"{line}, backend {BACKEND_NAMES[backend]}", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``run`` under the exit-code policy: one ``error:`` line and the error class's exit code on failure."""
    return run_cli(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
