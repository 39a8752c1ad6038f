"""Verification of moss-npu against the official code: the conformance runner and its case handlers.

Apart from the runtime package on purpose: a user who installs moss-npu to speak never runs this, and
``moss_npu`` imports nothing from here (tests/test_layering.py). ``python -m moss_npu_verify.goldens
FIXTURE_DIR`` checks one fixture folder; ``python -m moss_npu_verify.make_test_codec DIR`` writes the tiny
Delay test codec. See docs/accuracy.md.
"""
