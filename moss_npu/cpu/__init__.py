"""The CPU path of the Nano decoder: the frame step (``step``: weights in tiles, the blocks, the one-slot row
step), its one-row products (``matvec``), bf16/int8 weights (``quantize``), packed products for several rows
(``packed``), the thread policy (``threads``) and which of the C library's instruction sets runs (``targets``;
the library itself is ``moss_npu.native``'s). Imports nothing of the decoder (``nano``): it reads a model through
``contract``."""
