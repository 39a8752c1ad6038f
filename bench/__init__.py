"""Speed benchmarks of moss-npu (not part of the test suite): ``python -m bench.run --help``."""
