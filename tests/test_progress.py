"""``moss_npu.progress``: a bar only on a terminal, else one line per chunk and a bounded heartbeat."""

import io

from moss_npu.progress import Progress, pick_display


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_display_follows_the_stream():
    assert pick_display(False, Terminal()) == "bar"
    assert pick_display(False, io.StringIO()) == "lines"
    assert pick_display(True, Terminal()) == "off"


def test_lines_one_per_serial_chunk():
    out, clock = io.StringIO(), Clock()
    with Progress("lines", 12.5, stream=out, clock=clock) as p:
        for chunk, frames in enumerate((3, 5)):
            for step in range(frames):
                clock.now += 0.1
                p.on_frame(chunk, step)
    assert out.getvalue().splitlines() == ["chunk 1: 3 frames (0.24 s of audio) in 0.3 s",  # until chunk 2 began
                                           "chunk 2: 5 frames (0.40 s of audio) in 0.4 s"]
    assert p.frames == {0: 3, 1: 5} and p.total_frames == 8


def test_counts_that_are_not_audio_claim_no_seconds():
    """The Delay model's decoding steps: its first steps complete no audio frame, so no "s of audio"."""
    out, clock = io.StringIO(), Clock()
    with Progress("lines", None, stream=out, clock=clock, unit="step") as p:
        for step in range(4):
            clock.now += 0.1
            p.on_frame(0, step)
    assert out.getvalue().splitlines() == ["chunk 1: 4 steps in 0.3 s"]  # timed from the first step


def test_lines_in_a_batch_end_each_chunk_once():
    """Chunks 0-2 generated together: chunk 1 stops after 2 steps, the others run 4; then a second batch."""
    out = io.StringIO()
    p = Progress("lines", 12.5, stream=out, clock=Clock())
    for step in range(4):
        for chunk in (0, 1, 2):
            if chunk != 1 or step < 2:
                p.on_frame(chunk, step)
    p.on_frame(3, 0)
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["chunk 2", "chunk 1", "chunk 3", "chunk 4"]
    assert p.frames == {0: 4, 1: 2, 2: 4, 3: 1}
    assert p.chunks_at_cap(4) == [0, 2]


def test_heartbeat_at_most_every_ten_seconds():
    out, clock = io.StringIO(), Clock()
    p = Progress("lines", 12.5, stream=out, clock=clock)
    for step in range(100):  # one frame per second
        clock.now += 1.0
        p.on_frame(0, step)
    beats = [line for line in out.getvalue().splitlines() if line.endswith("so far")]
    assert len(beats) == 10 and beats[0] == "chunk 1: 10 frames (0.80 s of audio) so far"


def test_streamed_frames_count_per_chunk():
    out = io.StringIO()
    with Progress("lines", 12.5, stream=out, clock=Clock()) as p:
        p.add_frames(0, 1)
        p.add_frames(0, 2)
        p.add_frames(1, 4)
    assert p.frames == {0: 3, 1: 4}
    assert len(out.getvalue().splitlines()) == 2


def test_bar_without_a_total_never_breaks_a_run():
    """The bug of issue 10: ``if bar`` on a ``tqdm(total=None)`` raised TypeError on every terminal run."""
    out = Terminal()
    with Progress("bar", 12.5, stream=out) as p:
        for step in range(5):
            p.on_frame(0, step)
        p.add_frames(1, 3)
    assert p.total_frames == 8


def test_an_aborted_run_prints_no_finished_lines():
    out = io.StringIO()
    try:
        with Progress("lines", 12.5, stream=out, clock=Clock()) as p:
            p.on_frame(0, 0)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue() == ""


def test_a_library_warning_during_a_bar_gets_its_own_line(monkeypatch):
    """A warning logged while the bar is drawn (the CPU kernels built at the first frame) is written on a line of
    its own, not glued to the end of the bar's text."""
    import logging

    from moss_npu.cli import configure_logging

    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    configure_logging()
    with Progress("bar", 12.5, stream=err) as p:
        p.on_frame(0, 0)
        logging.getLogger("moss_npu.test").warning("kernels built")
    line = next(part for part in err.getvalue().split("\n") if "kernels built" in part)
    assert line.split("\r")[-1] == "warning: kernels built"
