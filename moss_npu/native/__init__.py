"""The package's one C library: how it is compiled (``build``, also run by ``setup.py``) and loaded (``library``).
The CPU kernels (``cpu``) and the text search (``text``) both call into it; this package imports neither."""
