"""Native MOSS-TTS-Nano language model: config, checkpoint loading, tokenizer, prompt rows, text chunking and
the frame-by-frame generation loop (spec: docs/nano_spec.md §1-§11)."""
