"""The CPU thread policy (moss_npu.cpu.threads): the default count, the cores a thread may borrow, torch's pool set
(numpy's BLAS is the CPU step's), and a frame's temporary limit of its own thread that gives the setting back."""

import torch
from threadpoolctl import threadpool_info

from moss_npu.cpu import threads


def blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_default_is_one_thread_on_two_cores_else_one_per_core(monkeypatch):
    for cores, expected in ((1, 1), (2, 1), (4, 4), (16, 16)):
        monkeypatch.setattr(threads, "usable_physical_cores", lambda cores=cores: cores)
        assert threads.default_threads() == expected


def test_a_thread_may_borrow_as_many_cores_again_as_are_left(monkeypatch):
    """The engine's two threads of ``count`` each, or a pipeline's one under the default: up to ``count`` more, never
    beyond the physical cores, none when the count takes them all."""
    for cores, count, expected in ((2, 1, 1), (1, 1, 0), (4, 1, 1), (4, 2, 2), (4, 3, 1), (16, 16, 0), (4, 6, 0)):
        monkeypatch.setattr(threads, "usable_physical_cores", lambda cores=cores: cores)
        assert threads.spare_cores(count) == expected


def test_a_lone_thread_borrows_under_the_default_setting_only(monkeypatch):
    monkeypatch.setattr(threads, "usable_physical_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        threads.set_threads(0)
        assert threads.borrowed_cores(0) == 1
        threads.set_threads(1)
        assert threads.borrowed_cores(1) == 0  # the user's one thread stays one
    finally:
        threads.set_threads(before)


def test_set_threads_sets_torch_and_leaves_blas_to_the_step():
    before = torch.get_num_threads()
    try:
        threads.limit_blas(1)
        assert threads.set_threads(2) == 2
        assert torch.get_num_threads() == 2 and set(blas_threads()) == {1}
        assert threads.set_threads(0) == threads.default_threads()
    finally:
        threads.set_threads(before)


def test_a_limit_is_this_threads_and_given_back():
    """torch's count is lowered in the calling thread for the block and given back; numpy's BLAS (one count per
    process, which other threads may be using) is not touched."""
    before = torch.get_num_threads()
    try:
        threads.set_threads(2)
        threads.limit_blas(2)
        with threads.this_thread_limited(1):
            assert torch.get_num_threads() == 1 and set(blas_threads()) == {2}
        assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}
    finally:
        threads.set_threads(before)
        threads.limit_blas(1)


def test_a_count_for_a_block_may_raise_this_threads_and_is_given_back():
    before = torch.get_num_threads()
    try:
        threads.set_threads(1)
        with threads.this_thread_using(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads.this_thread_limited(4):  # a limit never raises
            assert torch.get_num_threads() == 1
    finally:
        threads.set_threads(before)
