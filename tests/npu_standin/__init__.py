"""The stand-in "npu" device: a PrivateUse1 backend in C++ (``standin.cpp``) and a test-only ``torch_npu`` package
that registers it the way torch_npu registers itself. Products run on it in subprocesses (``run_on_standin``),
never inside the pytest process, whose torch must keep its fakes.
"""
