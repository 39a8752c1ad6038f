"""MOSS-TTS "Delay" fallback backend: GGUF backbone through llama-cpp-python, NumPy heads, ONNX codec.

Entry point: ``DelayPipeline.from_config(config_path, weights_dir, codec_onnx_dir, overrides)`` in
``moss_npu.delay.pipeline``. Importing this package loads neither llama.cpp nor onnxruntime.
Spec: shared/docs/delay_spec.md.
"""
