"""MOSS-TTS "Delay" fallback backend: GGUF backbone through llama-cpp-python, NumPy heads, ONNX codec.

Entry points in ``moss_npu.delay.pipeline``: ``DelayPipeline.from_config(config_path, weights_dir,
codec_onnx_dir, overrides)`` or ``DelayPipeline.open(run_config, weights_dir, codec_onnx_dir)``; the CLI's
flags become a run in ``moss_npu.delay.flags``. Importing this package loads neither llama.cpp nor
onnxruntime, and nothing here needs torch (it only accelerates the audio heads when present).
How it works: docs/delay.md.
"""
