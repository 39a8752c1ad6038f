"""A session of the WebSocket ``/v1/audio/speech/stream``: text in as it is written, audio out per sentence.

vLLM-Omni's protocol, as docs/serving-features.md describes it. A sentence is submitted once it is complete (the
splitter of ``moss_npu.tts.prepare``), at most ``LOOKAHEAD`` ahead of the one playing, and the pipeline's pause
goes before every sentence but the first, so a session's audio equals the same text sent whole.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional

import torch
from fastapi import WebSocket, WebSocketDisconnect

from moss_npu.serve.drain import Deadline, Drain, shutting_down
from moss_npu.serve.errors import ApiError, from_engine, shown
from moss_npu.serve.formats import StreamConverter, encode_file, pcm16, wav_stream_header
from moss_npu.serve.pool import Ticket, WorkerPool
from moss_npu.serve.schema import SpeechBody, check_body, parse_json, speech_body
from moss_npu.tts.prepare import split_sentences
from moss_npu.tts.timeline import pause

log = logging.getLogger("moss_npu.serve")
LOOKAHEAD = 2  # sentences of one session generating at once (the one playing and the next)
HTTP_ONLY = ("input", "stream", "stream_format")  # SpeechBody fields a session does not take
MAX_MESSAGE_CHARS = 2**20  # one client message; far above any piece an LLM streams


class Session:
    """One WebSocket session: reads the text, submits each sentence, streams the audio back in order."""

    def __init__(self, ws: WebSocket, pool: WorkerPool, make_job: Callable[[SpeechBody], dict], config: Any,
                 drain: Drain) -> None:
        self.ws, self.pool, self.make_job, self.config, self.drain = ws, pool, make_job, config, drain
        self.stopping = asyncio.Event()  # set when the server drains: read no more text
        self.fields: dict = {}
        self.stream_audio = True
        self.sentences: asyncio.Queue = asyncio.Queue()  # str, then None at input.done
        self.tickets: asyncio.Queue = asyncio.Queue()  # (index, sentence, ticket, body), then None
        self.slots = asyncio.Semaphore(LOOKAHEAD)
        self.open_tickets: list[Ticket] = []
        self.samples = 0  # of the session's audio so far, at the model's rate (speed applied)
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.spoken = 0  # sentences whose audio is complete

    async def run(self) -> None:
        """Serve the session until ``session.done``, an error, or the client leaving."""
        tasks: list[asyncio.Task] = []
        try:
            with self.drain.listening(self.stopping.set):
                await self._serve(tasks)
        except ApiError as exc:
            await self._fail(exc)
        except WebSocketDisconnect:
            pass
        except Exception:  # noqa: BLE001 - a bug: the client gets the error event, the log the traceback
            log.exception("WebSocket session failed")
            await self._fail(ApiError(500, "internal server error; see the server log", code="internal_error"))
        finally:
            for task in tasks:
                task.cancel()
            for ticket in self.open_tickets:
                ticket.abandon()

    async def _serve(self, tasks: list[asyncio.Task]) -> None:
        """Configure, then read, submit and speak concurrently (``tasks``: the first two, for ``run`` to end)."""
        self._configure(await self._receive())
        tasks += [asyncio.create_task(self._read()), asyncio.create_task(self._submit())]
        await self._speak()
        await self.ws.send_json({"type": "session.done", "total_sentences": self.spoken, "usage": {
            **self.usage, "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"]}})
        await self.ws.close()

    async def _unless_stopping(self, awaitable: Awaitable) -> Any:
        """Await ``awaitable`` unless the server starts draining first (then 503 ``shutting_down``)."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the idle timeout: nothing may read the next message in our place
            task.cancel()
            raise
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            raise shutting_down()
        return task.result()

    async def _receive(self) -> dict:
        """The next client message, checked for size, then parsed off the event loop."""
        try:
            text = await self._unless_stopping(self.ws.receive_text())
        except (KeyError, TypeError):  # a binary frame
            raise ApiError(400, "messages must be JSON text frames with a 'type'", code="invalid_json") from None
        if len(text) > MAX_MESSAGE_CHARS:
            raise ApiError(413, f"a message of {len(text)} characters; send text in pieces of at most "
                           f"{MAX_MESSAGE_CHARS}", code="message_too_large")
        message = await asyncio.to_thread(parse_json, text, "the message")
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ApiError(400, "messages must be JSON objects with a 'type'", code="invalid_json")
        return message

    def _configure(self, message: dict) -> None:
        """Check ``session.config`` completely (a sentence of it is checked as a request) before any text."""
        if message.get("type") != "session.config":
            raise ApiError(400, f"the first message must be session.config, got {shown(message.get('type'))}",
                           param="type", code="invalid_value")
        fields = {k: v for k, v in message.items() if k != "type"}
        self.stream_audio = fields.pop("stream_audio", True)
        if not isinstance(self.stream_audio, bool):
            raise ApiError(400, "stream_audio must be true or false", param="stream_audio", code="invalid_value")
        refused = sorted(set(fields) & set(HTTP_ONLY))
        if refused:
            raise ApiError(400, f"{refused[0]}: not a session setting (the text comes as input.text messages)",
                           param=refused[0], code="invalid_value")
        self.fields = {"response_format": "pcm", **fields, "stream": self.stream_audio}
        self._body("x")  # every setting checked now, with a placeholder text

    def _body(self, text: str) -> SpeechBody:
        body = speech_body({**self.fields, "input": text})
        rate, channels = self.pool.audio_format()
        check_body(body, model_names=self.config.model_names, max_chars=self.config.max_input_chars,
                   sample_rate=rate, channels=channels)
        return body

    async def _read(self) -> None:
        """Collect input.text pieces into sentences until input.done."""
        buffer = ""
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self._receive(), self.config.request_timeout_s)
                except asyncio.TimeoutError:
                    raise ApiError(400, f"no message for {self.config.request_timeout_s:g} s; send input.text or "
                                   "input.done", code="timeout") from None
                kind = message["type"]
                if kind == "input.text":
                    if not isinstance(message.get("text"), str):
                        raise ApiError(400, "input.text needs a string 'text'", param="text", code="invalid_value")
                    sentences, buffer = await asyncio.to_thread(self._split, buffer + message["text"])
                    for sentence in sentences:
                        await self.sentences.put(sentence)
                elif kind == "input.done":
                    for sentence in split_sentences(buffer, final=True)[0]:
                        await self.sentences.put(sentence)
                    await self.sentences.put(None)
                    return
                else:
                    raise ApiError(400, f"unknown message type {shown(kind)}; send input.text or input.done",
                                   param="type", code="invalid_value")
        except ApiError as exc:
            await self.sentences.put(exc)

    def _split(self, buffer: str) -> tuple[list[str], str]:
        """The complete sentences of ``buffer`` and its rest; a rest without sentence marks longer than one
        request may hold is cut at its last space before the limit (in time linear in its length)."""
        sentences, rest = split_sentences(buffer)
        limit, start = self.config.max_input_chars, 0
        while len(rest) - start > limit:
            cut = rest.rfind(" ", start, start + limit) + 1 or start + limit
            if rest[start:cut].strip():
                sentences.append(rest[start:cut].strip())
            start = cut
        return sentences, rest[start:]

    async def _submit(self) -> None:
        """Submit sentences as they complete, at most LOOKAHEAD ahead of the one being spoken."""
        index = 0
        while True:
            sentence = await self.sentences.get()
            if sentence is None or isinstance(sentence, ApiError):
                await self.tickets.put(sentence)
                return
            await self.slots.acquire()
            try:
                body = self._body(sentence)
                ticket = self.pool.submit(self.make_job(body))
            except ApiError as exc:
                await self.tickets.put(exc)
                return
            self.open_tickets.append(ticket)
            await self.tickets.put((index, sentence, ticket, body))
            index += 1

    async def _speak(self) -> None:
        """Stream each submitted sentence's audio in order, with the pause between sentences."""
        previous = None
        while True:
            item = await self.tickets.get()
            if item is None:
                return
            if isinstance(item, ApiError):
                raise item
            index, sentence, ticket, body = item
            try:
                await self._sentence(index, sentence, ticket, body, previous)
            finally:
                ticket.abandon()
                self.open_tickets.remove(ticket)
                self.slots.release()
            previous, self.spoken = sentence, self.spoken + 1

    async def _sentence(self, index: int, sentence: str, ticket: Ticket, body: SpeechBody,
                        previous: Optional[str]) -> None:
        rate, channels = self.pool.audio_format()
        out_rate, out_channels = body.sample_rate or rate, channels if body.channels is None else body.channels
        converter = StreamConverter(rate, out_rate, out_channels)
        await self.ws.send_json({"type": "audio.start", "sentence_index": index, "sentence_text": sentence,
                                 "format": body.response_format, "sample_rate": out_rate, "channels": out_channels})
        start_s, sent, whole = self.samples / rate, 0, []
        if self.stream_audio and body.response_format == "wav":
            sent += await self._send(wav_stream_header(out_rate, out_channels))

        async def audio(wave: torch.Tensor) -> None:
            nonlocal sent
            self.samples += wave.shape[1]
            converted = converter.push(wave)
            if self.stream_audio:
                sent += await self._send(pcm16(converted))
            else:
                whole.append(converted)

        if previous is not None:
            await audio(torch.zeros(channels, pause(previous, rate, body.speed)))
        offset, stamps = self.samples / rate, []
        deadline = Deadline(asyncio.get_running_loop().time() + self.config.request_timeout_s, self.drain)
        while True:
            event = await deadline.next_event(ticket)
            if event[0] == "chunk":
                await audio(torch.from_numpy(event[1]))
            elif event[0] == "timestamp":
                stamps.append({**event[1], "start": round(event[1]["start"] + offset, 6),
                               "end": round(event[1]["end"] + offset, 6)})
            elif event[0] == "done":
                break
            else:
                raise from_engine(event[1], event[2])
        tail = converter.flush()
        if self.stream_audio:
            sent += await self._send(pcm16(tail))
        else:
            wave = torch.cat([*whole, tail], dim=1)
            sent += await self._send(await asyncio.to_thread(encode_file, wave, out_rate, body.response_format,
                                                             body.sample_format))
        info = event[1]
        self.usage["input_tokens"] += int(info["input_tokens"])
        self.usage["output_tokens"] += int(info["frames"])
        for message in info.get("warnings", ()):  # a text chunk the model spoke nothing of (``tts.loop``)
            await self.ws.send_json({"type": "audio.warning", "sentence_index": index, "message": message})
        await self.ws.send_json({"type": "audio.done", "sentence_index": index, "total_bytes": sent,
                                 "start": round(start_s, 6), "end": round(self.samples / rate, 6),
                                 "timestamps": stamps})

    async def _send(self, data: bytes) -> int:
        if data:
            await self.ws.send_bytes(data)
        return len(data)

    async def _fail(self, exc: ApiError) -> None:
        """Send the error event and close: 1008 for a request the client can fix, 1001 (going away) for a server
        that stops, 1011 for a server failure."""
        code = 1008 if exc.status < 500 else 1001 if exc.code == "shutting_down" else 1011
        try:
            await self.ws.send_json({"type": "error", **exc.body()})
            await self.ws.close(code=code)
        except (WebSocketDisconnect, RuntimeError):
            pass
