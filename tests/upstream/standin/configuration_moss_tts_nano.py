"""Stand-in: the official file defines MossTTSNanoConfig (only its presence matters to the tests)."""


class MossTTSNanoConfig:
    model_type = "moss_tts_nano"
