"""Bounds on run settings, shared by the run settings and the command-line parsers (no heavy imports here)."""

MAX_NEW_FRAMES = 7500  # 10 minutes per text chunk at 12.5 frames/s; bounds the caches allocated up front
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes at most a signed 64-bit value
