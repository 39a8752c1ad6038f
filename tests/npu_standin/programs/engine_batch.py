"""The engine on a device and on the CPU: four requests in one batch and a fifth admitted while they run; prints
JSON comparing each request's codes and audio with the CPU's (run by tests/test_npu_product.py on the stand-in)."""

import json
import sys

import torch

from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.engine import Engine, SpeechRequest

nano, device = sys.argv[1], sys.argv[2]
reference = f"{nano}/goldens/reference.wav"
requests = [
    SpeechRequest("Hello there, my friend.", settings=RunConfig(seed=7, max_new_frames=6)),
    SpeechRequest("A second voice clone request that splits into chunks.", prompt_audio=reference,
                  settings=RunConfig(seed=3, max_new_frames=5, voice_clone_max_text_tokens=8)),
    SpeechRequest("Short.", settings=RunConfig(do_sample=False, max_new_frames=4)),
    SpeechRequest("And so it goes on.", prompt_audio=reference, prompt_text="A recorded voice.",
                  settings=RunConfig(seed=4, max_new_frames=5)),
]
late = SpeechRequest("Admitted while the others run.", settings=RunConfig(seed=9, max_new_frames=6))


def run(where: str) -> list:
    """Each request's (codes, waveform): four submitted at once, the fifth after the first audio arrives."""
    tts = MossTTSNano.from_pretrained(f"{nano}/tts", f"{nano}/codec", device=where)
    with Engine(tts, max_batch=5) as engine:
        streams = [engine.submit(r) for r in requests]
        first = iter(streams[0])
        chunks = {0: [next(first)]}
        streams.append(engine.submit(late))
        chunks[0] += list(first)
        for i, stream in enumerate(streams[1:], 1):
            chunks[i] = list(stream)
    return [(s.codes.cpu(), torch.cat([c.waveform.cpu() for c in chunks[i]], dim=1)) for i, s in enumerate(streams)]


on_device, on_cpu = run(device), run("cpu")
print(json.dumps({
    "same_codes": [torch.equal(a[0], b[0]) for a, b in zip(on_device, on_cpu)],
    "audio_max_abs": [float((a[1] - b[1]).abs().max()) if a[1].shape == b[1].shape else None
                      for a, b in zip(on_device, on_cpu)],
    "frames": [[int(a[0].shape[0]), int(b[0].shape[0])] for a, b in zip(on_device, on_cpu)],
    "samples": [[int(a[1].shape[1]), int(b[1].shape[1])] for a, b in zip(on_device, on_cpu)],
}))
