"""Text normalization before synthesis, as the official command line does it (docs/text-normalization.md).

``TextNormalizer().prepare(text, prompt_text)`` returns what the model will read: the robust cleanup
(``robust``), WeTextProcessing's reading of numbers, dates, units and symbols in Chinese or English
(``wetext``), and the robust cleanup again.
"""

from moss_npu.text.normalize import NormalizedText, TextNormalizer

__all__ = ["NormalizedText", "TextNormalizer"]
