"""`python -m bench.bandwidth` prints its probe for the sizes asked for and refuses sizes it cannot measure."""

import re
import subprocess
import sys

import pytest

from bench import bandwidth


def test_the_module_prints_one_probe_line_per_size():
    out = subprocess.run([sys.executable, "-m", "bench.bandwidth", "--mib", "1", "--mib", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert len(out) == 2
    for line, mib in zip(out, (1, 2)):
        assert re.fullmatch(rf"read bandwidth \(fp32 tiles, {mib} MiB\): 1 thread [0-9.]+ GB/s \(ratio 1\.00\)", line), line


@pytest.mark.parametrize("argv", [["--mib", "0"], ["--threads", "0"], ["--threads", "one"]])
def test_a_size_or_thread_count_it_cannot_measure_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        bandwidth.main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("python -m bench.bandwidth: error: --")
