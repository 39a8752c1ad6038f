"""Stand-in: the official file defines the SentencePiece tokenizer; this one maps characters to ids."""


class MossTTSNanoSentencePieceTokenizer:
    pad_token_id = 3
    eos_token = "</s>"

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 16384 for ch in text]
