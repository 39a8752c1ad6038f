"""Bounds on run settings, shared by the run settings and the command-line parsers (no heavy imports here)."""

MAX_NEW_FRAMES = 7500  # 10 minutes per text chunk at 12.5 frames/s; bounds the caches allocated up front
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes at most a signed 64-bit value
# Reference recordings (CLI prompts, server uploads) are judged by their header against these before a sample is
# decoded, and decoding reads at most the duration allowed: a small file cannot claim gigabytes of samples.
MAX_REFERENCE_SECONDS = 120.0  # the LM's context holds ~122 s of frames (12.5 per second); a longer prompt cannot fit
MAX_REFERENCE_CHANNELS = 2  # the codec takes mono or stereo
MAX_REFERENCE_RATE = 384_000  # Hz; studio recordings go up to 384 kHz
