"""MOSS-TTS "Delay" fallback backend: GGUF backbone through llama-cpp-python, NumPy heads, ONNX codec.

``DelayPipeline.open(load_run_config(preset, overrides), weights_dir, codec_onnx_dir)`` (``pipeline``, ``config``);
the CLI's flags become a run in ``flags``. Importing this package loads neither llama.cpp nor onnxruntime, and
nothing here needs torch (it only accelerates the audio heads when present). How it works: docs/delay.md.
"""
