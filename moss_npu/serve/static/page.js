// The speech page: calls this server's API from the same origin (no libraries, nothing from elsewhere).
// Speak streams POST /v1/audio/speech as SSE (pcm deltas) and plays each delta through Web Audio as it
// arrives; the download is built from the same audio (wav, pcm) or fetched again with the same seed.
"use strict";

const RATE = 48000;
const CHANNELS = 2;
const $ = (id) => document.getElementById(id);
let config = { key_required: false, models: ["moss-tts-nano"], max_input_chars: 4096 };
let current = null; // the request in flight: { controller, context }

function authHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function showError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

function status(text) {
  $("status").textContent = text;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `${response.status} ${response.statusText}`;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadConfig() {
  const response = await fetch("/page/config.json");
  config = await response.json();
  $("key-row").hidden = !config.key_required;
  $("text").maxLength = config.max_input_chars;
}

async function loadVoices(select) {
  const response = await fetch("/v1/audio/voices", { headers: authHeaders() });
  if (!response.ok) {
    if (!(config.key_required && !$("api-key").value)) showError(await errorMessage(response));
    return;
  }
  const menu = $("voice");
  const keep = select || menu.value;
  menu.replaceChildren(new Option("default", "default"));
  for (const voice of (await response.json()).data) menu.add(new Option(voice.name, voice.id));
  menu.value = [...menu.options].some((o) => o.value === keep) ? keep : "default";
}

function requestBody(format, seed, sse) {
  const body = { model: config.models[0], input: $("text").value, voice: $("voice").value,
                 speed: Number($("speed").value), response_format: format, seed };
  if (sse) body.stream_format = "sse";
  if ($("max-frames").value !== "") body.max_new_frames = Number($("max-frames").value);
  if ($("greedy").checked) body.greedy = true;
  return body;
}

function decodeBase64(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

// Schedule interleaved s16le stereo right after what is already queued.
function play(context, bytes, clock) {
  const samples = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 2);
  const frames = samples.length / CHANNELS;
  if (!frames) return;
  const buffer = context.createBuffer(CHANNELS, frames, RATE);
  for (let c = 0; c < CHANNELS; c++) {
    const channel = buffer.getChannelData(c);
    for (let i = 0; i < frames; i++) channel[i] = samples[i * CHANNELS + c] / 32768;
  }
  const source = context.createBufferSource();
  source.buffer = buffer;
  source.connect(context.destination);
  clock.next = Math.max(clock.next, context.currentTime + 0.05);
  source.start(clock.next);
  clock.next += frames / RATE;
}

function wavFile(pcm) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((ch, i) => header.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF"); header.setUint32(4, 36 + pcm.byteLength, true); text(8, "WAVE"); text(12, "fmt ");
  header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, CHANNELS, true);
  header.setUint32(24, RATE, true); header.setUint32(28, RATE * CHANNELS * 2, true);
  header.setUint16(32, CHANNELS * 2, true); header.setUint16(34, 16, true); text(36, "data");
  header.setUint32(40, pcm.byteLength, true);
  return new Blob([header, pcm], { type: "audio/wav" });
}

function joined(pieces) {
  const out = new Uint8Array(pieces.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of pieces) { out.set(p, at); at += p.length; }
  return out;
}

function addTimestamp(event) {
  const item = document.createElement("li");
  item.textContent = `${event.start.toFixed(2)}–${event.end.toFixed(2)} s: ${event.text}`;
  $("timestamps").append(item);
}

// Read an SSE body; call onEvent with each JSON event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) onEvent(JSON.parse(line.slice(6)));
    }
  }
}

async function download(format, seed, pcm) {
  if (format === "wav") return wavFile(pcm);
  if (format === "pcm") return new Blob([pcm], { type: "audio/pcm" });
  // Another format: the same request once more, whole; the seed makes it the same audio.
  const response = await fetch("/v1/audio/speech", {
    method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify(requestBody(format, seed, false)) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return await response.blob();
}

async function speak() {
  stop();
  showError("");
  $("result").hidden = true;
  $("timestamps").replaceChildren();
  const format = $("format").value;
  const seed = $("seed").value !== "" ? Number($("seed").value) : Math.floor(Math.random() * 2 ** 31);
  const context = new AudioContext({ sampleRate: RATE });
  const controller = new AbortController();
  current = { controller, context };
  const clock = { next: 0 };
  const pieces = [];
  const started = performance.now();
  let first = null;
  let failed = null;
  $("speak").disabled = true;
  $("stop").disabled = false;
  status("generating…");
  try {
    const response = await fetch("/v1/audio/speech", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody("pcm", seed, true)), signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (event) => {
      if (event.type === "speech.audio.delta") {
        const bytes = decodeBase64(event.audio);
        if (first === null && bytes.length) first = performance.now() - started;
        pieces.push(bytes);
        play(context, bytes, clock);
        const seconds = pieces.reduce((n, p) => n + p.length, 0) / (RATE * CHANNELS * 2);
        status(`playing… ${seconds.toFixed(2)} s generated`);
      } else if (event.type === "speech.audio.timestamp") {
        addTimestamp(event);
      } else if (event.type === "error") {
        failed = (event.error && event.error.message) || "the stream failed";
      }
    });
    if (failed) throw new Error(failed);
    const pcm = joined(pieces);
    const seconds = pcm.byteLength / (RATE * CHANNELS * 2);
    $("player").src = URL.createObjectURL(wavFile(pcm));
    const file = await download(format, seed, pcm);
    $("download").href = URL.createObjectURL(file);
    $("download").download = `speech.${format}`;
    $("download").textContent = `Download ${format}`;
    $("result").dataset.seconds = seconds.toFixed(3);
    $("result").hidden = false;
    status(`${seconds.toFixed(2)} s of audio, first sound after ${Math.round(first || 0)} ms`);
  } catch (error) {
    if (error.name !== "AbortError") showError(error.message);
    status("");
  } finally {
    $("speak").disabled = false;
    $("stop").disabled = true;
  }
}

function stop() {
  if (!current) return;
  current.controller.abort();
  current.context.close();
  current = null;
}

async function upload(event) {
  event.preventDefault();
  showError("");
  const form = new FormData();
  form.append("name", $("voice-name").value);
  form.append("audio", $("voice-file").files[0]);
  if ($("voice-transcript").value.trim()) form.append("transcript", $("voice-transcript").value.trim());
  $("upload-button").disabled = true;
  $("upload-status").textContent = "encoding…";
  try {
    const response = await fetch("/v1/audio/voices", { method: "POST", headers: authHeaders(), body: form });
    if (!response.ok) throw new Error(await errorMessage(response));
    const voice = await response.json();
    await loadVoices(voice.id);
    $("upload-status").textContent = `added ${voice.name}`;
  } catch (error) {
    showError(error.message);
    $("upload-status").textContent = "";
  } finally {
    $("upload-button").disabled = false;
  }
}

async function main() {
  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", () => { stop(); status("stopped"); });
  $("upload").addEventListener("submit", upload);
  $("api-key").addEventListener("change", () => { showError(""); loadVoices(); });
  await loadConfig();
  await loadVoices();
  document.body.dataset.ready = "1";
}

main().catch((error) => showError(error.message));
