"""Stand-in: the official file defines MossAudioTokenizerConfig (only its presence matters to the tests)."""


class MossAudioTokenizerConfig:
    model_type = "moss-audio-tokenizer"
