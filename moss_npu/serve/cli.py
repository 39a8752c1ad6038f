"""Command line of the speech server (``python -m moss_npu.serve`` / ``moss-npu-serve``).

    python -m moss_npu.serve --model DIR --codec DIR --device npu:0            # 127.0.0.1:8000
    MOSS_NPU_API_KEY=KEY python -m moss_npu.serve --model DIR --codec DIR --device npu:0,npu:1 --host 0.0.0.0

A server on a non-loopback address needs an API key (MOSS_NPU_API_KEY, --api-key-file, or --api-key, which
shows in ps). A keyless server answers only requests whose Host names it (--allowed-hosts adds names) and
refuses browser writes from other origins (--cors-origins allows some).

One worker process per listed device (``--device cpu,cpu`` runs two on the CPU, sharing its cores). The
server listens at once; ``GET /health`` answers 200 once a worker has loaded and warmed up. SIGTERM or Ctrl-C
drains: /health turns 503, new requests get 503 shutting_down, requests in flight finish (within
--shutdown-grace); a second signal stops at once. Exit codes: 0 stopped, 1 runtime failure (port taken, a
worker crashed while loading), 2 bad input (folders, flags), 130 Ctrl-C or SIGTERM (after the drain). Every
failure is one ``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from moss_npu.cli import ArgumentParser, device_spec, run_cli
from moss_npu.errors import BAD_INPUT, INTERRUPTED, RUNTIME_FAILURE, InputError, MissingDependency
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL, resolve_model_dir
from moss_npu.limits import MAX_NEW_FRAMES, MAX_REFERENCE_SECONDS
from moss_npu.serve.errors import ServerError
from moss_npu.serve.spec import WorkerSpec

if TYPE_CHECKING:
    from moss_npu.serve.app import ServerConfig


def default_voices_dir() -> Path:
    """``$XDG_DATA_HOME/moss-npu/voices`` (``~/.local/share/moss-npu/voices``)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "moss-npu" / "voices"


def program_name() -> str:
    """How the server was started, for usage and error lines: the console script or the module."""
    return "moss-npu-serve" if Path(sys.argv[0]).name == "moss-npu-serve" else "python -m moss_npu.serve"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=program_name(), description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="MOSS-TTS-Nano folder or hub id")
    p.add_argument("--codec", default=DEFAULT_CODEC, help="MOSS-Audio-Tokenizer-Nano folder or hub id")
    p.add_argument("--device", default="auto", help="device, or a comma-separated list: one worker each")
    p.add_argument("--dtype", help="LM dtype (default: the device's, fp32 on CPU; bfloat16 on the CPU: bf16 "
                                   "weights, float32 arithmetic)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health; visible in "
                                     "ps, so prefer the environment variable MOSS_NPU_API_KEY or --api-key-file")
    p.add_argument("--api-key-file", type=Path, help="read the API key from this file (first line)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names a keyless server also answers to ('*': any)")
    p.add_argument("--cors-origins", default="",
                   help="comma-separated origins allowed to call from a browser, e.g. https://app.example ('*': any)")
    p.add_argument("--model-name", default="moss-tts-nano", help="the model id clients send and /v1/models lists")
    p.add_argument("--voices-dir", type=Path, default=default_voices_dir(),
                   help="where uploaded voices are stored (may be shared by several servers; default "
                        "$XDG_DATA_HOME/moss-npu/voices, i.e. ~/.local/share/moss-npu/voices)")
    p.add_argument("--max-batch", type=int, default=8, help="engine slots per worker")
    p.add_argument("--max-queue", type=int, default=32, help="requests that may wait beyond the slots (then 429)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request may take (then 504)")
    p.add_argument("--max-input-chars", type=int, default=4096, help="longest input text (then 413)")
    p.add_argument("--max-new-frames", type=int, default=375,
                   help="default and upper limit of a request's frames per text chunk (12.5 per second)")
    p.add_argument("--max-upload-mb", type=float, default=10.0, help="largest voice upload / ref_audio")
    p.add_argument("--max-voice-seconds", "--max-reference-seconds", dest="max_voice_seconds", type=float,
                   default=30.0, help="longest voice recording or ref_audio, judged from its header (at most 120)")
    p.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request body may take to arrive "
                                                                    "(then 408)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send its request headers (then it is closed)")
    p.add_argument("--keep-alive", type=int, default=5, help="seconds an idle kept-alive connection stays open")
    p.add_argument("--shutdown-grace", type=float,
                   help="seconds a stop signal waits for requests in flight to finish (default: --request-timeout, "
                        "which no request outlasts)")
    p.add_argument("--max-connections", type=int, default=1000,
                   help="open connections and requests at most (then uvicorn answers 503 at once)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="intra-op CPU threads per worker (0: the cores but one, shared among CPU workers)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _check(args: argparse.Namespace) -> list[str]:
    """Validate flags and folders before anything starts; return the device list."""
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    if not devices:
        raise InputError(f"--device {args.device!r}: name at least one device, e.g. cpu or npu:0,npu:1")
    for device in devices:
        try:
            device_spec(device)
        except argparse.ArgumentTypeError as exc:
            raise InputError(f"--device {exc}") from None
    for name, value, low, high in (("--max-batch", args.max_batch, 1, 256), ("--max-queue", args.max_queue, 0, 10**5),
                                   ("--max-input-chars", args.max_input_chars, 1, 10**6), ("--port", args.port, 0, 65535),
                                   ("--max-new-frames", args.max_new_frames, 1, MAX_NEW_FRAMES),
                                   ("--num-threads", args.num_threads, 0, 1024)):
        if not low <= value <= high:
            raise InputError(f"{name} {value}: use {low}..{high}")
    for name, value in (("--request-timeout", args.request_timeout), ("--max-upload-mb", args.max_upload_mb),
                        ("--max-voice-seconds", args.max_voice_seconds), ("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout), ("--keep-alive", args.keep_alive),
                        ("--max-connections", args.max_connections)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{name} {value}: use a positive number")
    if args.shutdown_grace is None:
        args.shutdown_grace = args.request_timeout
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):
        raise InputError(f"--shutdown-grace {args.shutdown_grace}: use 0 or more seconds")
    if args.max_voice_seconds > MAX_REFERENCE_SECONDS:
        raise InputError(f"--max-voice-seconds {args.max_voice_seconds:g}: use at most {MAX_REFERENCE_SECONDS:g} (a "
                         "longer recording does not fit the model's context)")
    args.api_key = _api_key(args)
    args.allowed_hosts = _listed(args.allowed_hosts)
    args.cors_origins = _listed(args.cors_origins)
    if args.api_key is None and not _is_loopback(args.host):
        raise InputError(f"--host {args.host} without an API key would let anyone who reaches this address use and "
                         "fill the server; set MOSS_NPU_API_KEY (or --api-key-file), or listen on 127.0.0.1")
    try:
        args.voices_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--voices-dir {args.voices_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(args.voices_dir, os.W_OK):
        raise InputError(f"--voices-dir {args.voices_dir}: not writable; pass a folder you can write")
    args.model = str(resolve_model_dir(args.model, required=("config.json", "tokenizer.model")))
    args.codec = str(resolve_model_dir(args.codec, required=("config.json",)))
    return devices


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` (limits, names, access policy) that checked flags (``_check``) ask for."""
    from moss_npu.serve.app import ServerConfig

    return ServerConfig(voices_dir=args.voices_dir.resolve(), model_names=(args.model_name,), api_key=args.api_key,
                        max_input_chars=args.max_input_chars, max_new_frames=args.max_new_frames,
                        request_timeout_s=args.request_timeout, max_upload_bytes=int(args.max_upload_mb * 2**20),
                        max_voice_seconds=args.max_voice_seconds, body_timeout_s=args.body_timeout,
                        bind_host=args.host, allowed_hosts=args.allowed_hosts, cors_origins=args.cors_origins)


def worker_spec(args: argparse.Namespace, device: str) -> WorkerSpec:
    """What a worker on ``device`` loads and how it runs, from checked flags (``_check``)."""
    return WorkerSpec(model=args.model, codec=args.codec, device=device, dtype=args.dtype, max_batch=args.max_batch,
                      num_threads=args.num_threads, max_new_frames=args.max_new_frames)


def _api_key(args: argparse.Namespace) -> Optional[str]:
    """The key from --api-key-file, --api-key (warned: it shows in ps) or MOSS_NPU_API_KEY, in that order."""
    if args.api_key_file is not None and args.api_key is not None:
        raise InputError("pass --api-key-file or --api-key, not both")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--api-key-file {args.api_key_file}: cannot read it ({exc})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise InputError(f"--api-key-file {args.api_key_file}: the first line is empty; write the key there")
        return key
    if args.api_key is not None:
        if not args.api_key.strip():
            raise InputError("--api-key is empty; pass a key or leave the flag out")
        print("warning: --api-key shows in the process list (ps); prefer MOSS_NPU_API_KEY or --api-key-file",
              file=sys.stderr)
        return args.api_key.strip()
    key = os.environ.get("MOSS_NPU_API_KEY", "").strip()
    return key or None


def _listed(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (a loopback address or ``localhost``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    """Check the flags, then serve until Ctrl-C (the exit-code policy of ``moss_npu.cli``)."""
    return run_cli(lambda: serve(build_parser().parse_args(argv)))


def serve(args: argparse.Namespace) -> int:
    """Start the workers and the HTTP server; return 130 once stopped by a signal, 0 otherwise.

    The workers are spawned as soon as the flags and the port are checked, before this process imports the
    HTTP app (torch, FastAPI: ~1.5 s), so that both start at once on a machine with two cores or more.
    """
    devices = _check(args)
    try:
        import uvicorn

        from moss_npu.serve.metrics import Metrics
        from moss_npu.serve.pool import WorkerPool, specs_for
    except ImportError as exc:
        raise _missing(exc) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    fatal: list[tuple[str, bool]] = []
    holder: dict = {}

    def on_fatal(message: str, user_fault: bool) -> None:
        fatal.append((message, user_fault))
        if "server" in holder:
            holder["server"].should_exit = True

    metrics = Metrics()
    pool = WorkerPool(specs_for(devices, worker_spec(args, device="")), max_queue=args.max_queue, metrics=metrics,
                      on_fatal=on_fatal)
    problem = _port_problem(args.host, args.port)
    if problem:
        raise ServerError(f"cannot listen on {args.host}:{args.port} ({problem}); pick another --port or --host")
    pool.start()  # the workers load while this process imports the app (torch, FastAPI): both at once
    try:
        try:
            from moss_npu.serve.app import create_app
            from moss_npu.serve.connections import ConnectionLimits
            from moss_npu.serve.drain import Drain
        except ImportError as exc:
            raise _missing(exc) from None
        drain = Drain(args.shutdown_grace)
        config = server_config(args)
        limits = ConnectionLimits(header_timeout_s=args.header_timeout, keep_alive_s=args.keep_alive,
                                  max_connections=args.max_connections)
        limits.raise_file_limit()
        server = _server_class()(uvicorn.Config(create_app(config, pool, metrics, drain=drain), host=args.host,
                                                port=args.port, log_level=args.log_level,
                                                timeout_graceful_shutdown=FINAL_WAIT_S, **limits.uvicorn_options()),
                                  drain)
        holder["server"] = server
        if fatal:  # a worker failed before the server existed: stop right after starting
            server.should_exit = True
        try:
            server.run()
        except SystemExit:  # uvicorn exits this way when it cannot start
            server.started = False
        if fatal:
            message, user_fault = fatal[0]
            raise ServerError(message, exit_code=BAD_INPUT if user_fault else RUNTIME_FAILURE)
        if not server.started:
            raise ServerError(f"could not listen on {args.host}:{args.port} (see the log above); pick another --port")
    finally:
        pool.close()  # the app's shutdown closed it already, unless the server never started
    return INTERRUPTED if getattr(server, "signals", []) else 0


def _missing(exc: ImportError) -> MissingDependency:
    return MissingDependency(f"the server needs the serve extra ({exc.name} is missing); run pip install -e '.[serve]'")


def _port_problem(host: str, port: int) -> Optional[str]:
    """Why ``host:port`` cannot be listened on (taken, no such address), or None; checked before workers start."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


FINAL_WAIT_S = 5  # after the drain: for the last bytes of answers to leave before uvicorn cancels what is left


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that drains on the first stop signal (``moss_npu.serve.drain``) and stops at the
        second, minus re-raising the signal after shutdown (that ends in a traceback)."""

        signals: list

        def __init__(self, config: uvicorn.Config, drain) -> None:
            super().__init__(config)
            self.drain = drain

        def handle_exit(self, sig, frame) -> None:
            self.signals = [*getattr(self, "signals", []), sig]
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and not self.drain.draining and not self.should_exit:
                loop.call_soon_threadsafe(self._begin_drain)  # not inside the signal handler: it interrupts the loop
            else:
                super().handle_exit(sig, frame)
                if len(self.signals) > 1:
                    self.force_exit = True
            self._captured_signals.clear()

        def _begin_drain(self) -> None:
            logging.getLogger("moss_npu.serve").info(
                "stopping: draining the requests in flight (up to %g s; signal again to stop at once)",
                self.drain.grace_s)
            self.drain.start()
            asyncio.ensure_future(self._exit_when_settled())

        async def _exit_when_settled(self) -> None:
            await self.drain.settled()
            self.should_exit = True

    return Server
