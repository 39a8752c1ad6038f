"""Native MOSS-TTS-Nano language model: config, checkpoint loading, tokenizer, prompt rows, text chunking and
the frame-by-frame generation loop (docs/architecture.md#the-language-model)."""
