"""Run the official MOSS-TTS-Nano remote code on any device with a maintained patch set (``--impl upstream``):
``patches/manifest.yaml`` lists what is patched and why, ``folder`` builds patched copies of the official folders,
``patches`` holds the replacements and their signature checks, ``tts`` loads everything (docs/upstream.md).
"""

from moss_npu.upstream.manifest import load_manifest
from moss_npu.upstream.patches import apply_patches
from moss_npu.upstream.tts import UpstreamGeneration, UpstreamTTS, import_transformers, load_upstream
