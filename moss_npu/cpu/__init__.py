"""The CPU path of the Nano decoder: the frame step (``step``: weights in tiles, the blocks, the one-slot row
step), its one-row products (``matvec``), bf16/int8 weights (``quantize``), packed products for several rows
(``packed``), the thread policy (``threads``) and the package's C library (``native``, built by
``native_build``). Imports nothing here: the torch-free Delay path may import ``native`` alone."""
