"""Text normalization before synthesis, as the official command line does it (docs/text-normalization.md):
``TextNormalizer().prepare(text, prompt_text)`` returns what the model will read.
"""

from moss_npu.text.normalize import NormalizedText, TextNormalizer

__all__ = ["NormalizedText", "TextNormalizer"]
