"""A stand-in for the official MOSS-TTS-Nano remote code, written for the tests (the official code cannot
be shipped). Every name the patch set touches exists with the official signature of
ml-inory/moss-tts-nano.axera@20017d781d46fe4307574fe05cc84228b4de9bec, and keeps the official CUDA-only
behaviour, so that the tests can see each patch change it; the bodies are otherwise trivial."""
