"""The prepared-weights cache (``moss_npu.cpu.prepared``, ``moss_npu.nano.prepared``): written whole or not at all,
keyed by the checkpoint's content, verified when read, refused when others can write it, and bit for bit what
preparing the weights in memory gives (greedy codes equal with and without it)."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moss_npu.cpu import prepared
from moss_npu.cpu.prepared import StaleEntry, WeightCache
from moss_npu.origin import origin_identity
from moss_npu.nano.prepared import DecoderWeights
from moss_npu.tts import MossTTSNano, RunConfig
from tests.optional import missing

REPO = Path(__file__).resolve().parents[2]
GREEDY = RunConfig(do_sample=False, max_new_frames=6)
TEXT = "Hello there, one more test."
PREPARING = "preparing the CPU weights of"


@pytest.fixture
def folders(tmp_path, monkeypatch, nano_fixture):
    """(model folder, codec folder, cache root): the nano-tiny checkpoint copied to a folder of this test (its own
    identity) and an empty cache of its own."""
    model = shutil.copytree(nano_fixture / "tts", tmp_path / "tts")
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOSS_NPU_CACHE_DIR", str(cache))
    return model, nano_fixture / "codec", cache


def load(folders, **kwargs) -> MossTTSNano:
    model, codec, _ = folders
    return MossTTSNano.from_pretrained(str(model), str(codec), device="cpu", **kwargs)


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "prepared").glob("*"))


def codes(tts: MossTTSNano) -> torch.Tensor:
    return tts.synthesize(TEXT, settings=GREEDY).codes


def preparing_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(PREPARING)]


def test_first_load_builds_the_cache_once_later_loads_map_it(folders, caplog):
    """One line when the entries are built, none when they are read; greedy codes and every prepared array equal
    with and without the cache."""
    caplog.set_level(logging.WARNING)
    first = load(folders)
    assert first.weights.source == "built" and len(preparing_lines(caplog)) == 1
    files = entries(folders[2])
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["tables.bin", "tiles.bin"]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)  # derived from the weights: this user's only
    caplog.clear()
    second = load(folders)
    assert second.weights.source == "cache" and preparing_lines(caplog) == []
    assert second.weights.frame_step.tile_arena.cached
    computed = DecoderWeights.build(second.model)  # no cache: what every start used to do
    assert computed.source == "computed"
    for cached, fresh in zip(second.weights.audio_qkv, computed.audio_qkv):
        assert torch.equal(cached, fresh)
    assert bytes(second.weights.frame_step.tile_arena.payload()) == bytes(computed.frame_step.tile_arena.payload())
    reference = codes(first)
    assert torch.equal(codes(second), reference)
    second.weights = computed
    assert torch.equal(codes(second), reference)


@pytest.mark.parametrize("load_settings", [dict(dtype="bfloat16"), dict(quantize="int8")], ids=["bf16", "int8"])
def test_reduced_precision_entries_are_their_own_and_exact(folders, load_settings):
    from moss_npu.cpu.quantize import int8_kernel_available

    if "quantize" in load_settings and not int8_kernel_available():
        missing("torch has no _weight_int8pack_mm")
    plain = load(folders)
    first = load(folders, **load_settings)
    assert first.weights.source == "built" and len(entries(folders[2])) == 4  # another key than float32's
    second = load(folders, **load_settings)
    assert second.weights.source == "cache"
    computed = DecoderWeights.build(second.model)
    assert bytes(second.weights.frame_step.tile_arena.payload()) == bytes(computed.frame_step.tile_arena.payload())
    assert torch.equal(codes(second), codes(first))
    assert plain.weights.source == "built"


def test_a_changed_checkpoint_is_never_served_stale(folders, caplog):
    caplog.set_level(logging.WARNING)
    load(folders)
    weights = folders[0] / "model.safetensors"
    save_file({k: v * 1.5 if v.ndim == 2 else v for k, v in load_file(weights).items()}, str(weights))  # same shapes
    caplog.clear()
    changed = load(folders)
    assert changed.weights.source == "built" and len(preparing_lines(caplog)) == 1
    computed = DecoderWeights.build(changed.model)
    assert bytes(changed.weights.frame_step.tile_arena.payload()) == bytes(computed.frame_step.tile_arena.payload())


@pytest.mark.parametrize("source", ["matvec.c", "matvec.py"])
def test_changed_code_is_never_served_stale(folders, caplog, monkeypatch, tmp_path, source):
    """Another C source (the kernels that read the tiles) or Python module of the CPU package (which fills them),
    same package version and layout: the entries are built again, not mapped."""
    from moss_npu.native import build as native_build

    caplog.set_level(logging.WARNING)
    assert load(folders).weights.source == "built"
    if source.endswith(".c"):
        changed = tmp_path / source
        changed.write_bytes(native_build.MATVEC.read_bytes() + b"/* tiles computed another way */\n")
        monkeypatch.setattr(native_build, "SOURCES", tuple(changed if p == native_build.MATVEC else p
                                                           for p in native_build.SOURCES))
    else:
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"# changed" if p.name == source else b""))
    caplog.clear()
    again = load(folders)
    assert again.weights.source == "built" and len(preparing_lines(caplog)) == 1


def test_edited_weights_are_prepared_in_memory_and_not_cached(folders):
    tts = load(folders)
    with torch.no_grad():
        tts.model.local_transformer.h[0].attn.c_attn.weight.mul_(2.0)
    assert origin_identity(tts.model) is None
    decoder = tts.decoder(1, 64)  # the pipeline sees the edit and prepares again, from the edited weights
    assert tts.weights.source == "computed" and decoder.weights is tts.weights
    fresh = DecoderWeights.build(tts.model)
    for mine, theirs in zip(tts.weights.audio_qkv, fresh.audio_qkv):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "header"])
def test_a_damaged_entry_is_rebuilt_with_one_line(folders, caplog, damage):
    first = load(folders)
    tiles = next(f for f in entries(folders[2]) if f.name.endswith("-tiles.bin"))
    data = bytearray(tiles.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40
    elif damage == "truncate":
        del data[-100:]
    elif damage == "empty":
        data = bytearray()
    else:
        data[20:30] = b"not a json"
    tiles.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    again = load(folders)
    damaged = [r.getMessage() for r in caplog.records if "are damaged or stale" in r.getMessage()]
    assert len(damaged) == 1 and tiles.name in damaged[0]
    assert again.weights.frame_step.tile_arena.cached is False
    assert torch.equal(codes(again), codes(first))
    assert load(folders).weights.source == "cache"  # written again, whole


def test_an_entry_others_can_write_is_refused_and_replaced(folders, caplog):
    load(folders)
    tiles = next(f for f in entries(folders[2]) if f.name.endswith("-tiles.bin"))
    tiles.chmod(0o666)
    caplog.set_level(logging.WARNING)
    again = load(folders)
    assert any("are not used: not a regular file of this user's" in r.getMessage() for r in caplog.records)
    assert not again.weights.frame_step.tile_arena.cached
    assert tiles.stat().st_mode & 0o777 == 0o600  # replaced by a file of this user's alone


def test_a_folder_others_can_write_is_neither_read_nor_written(folders, caplog):
    load(folders)
    folder = folders[2] / "prepared"
    before = {f.name: f.stat().st_mtime_ns for f in entries(folders[2])}
    folder.chmod(0o777)
    try:
        caplog.set_level(logging.WARNING)
        again = load(folders)
        assert again.weights.source == "built, not cached"
        assert any("writable by others" in r.getMessage() for r in caplog.records)
        assert {f.name: f.stat().st_mtime_ns for f in entries(folders[2])} == before
    finally:
        folder.chmod(0o700)


def test_a_failed_write_leaves_no_entry_and_no_temporary_file(folders, monkeypatch, caplog):
    real_replace = os.replace

    def replace(source, target, **kwargs):
        fd = kwargs["src_dir_fd"]
        with pytest.raises(FileNotFoundError):  # a reader never finds a half-written entry
            os.stat(target, dir_fd=fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepared.os, "replace", replace)
    caplog.set_level(logging.WARNING)
    tts = load(folders)
    assert tts.weights.source == "built, not cached"
    assert entries(folders[2]) == [] and not list((folders[2] / "prepared").glob(".*"))
    assert any("cannot write the prepared weights" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(prepared.os, "replace", real_replace)
    assert load(folders).weights.source == "built" and load(folders).weights.source == "cache"


def test_a_layout_that_differs_from_the_entry_is_stale(tmp_path):
    cache = WeightCache("k" * 32, tmp_path)
    arena = cache.arena("x", 1024, "test")
    arena.array((4, 8), np.float32, lambda out: out.fill(1.0))
    arena.array((16,), np.int8, lambda out: out.fill(-3))
    cache.save("x", arena)
    mapped = WeightCache("k" * 32, tmp_path).arena("x", 1024, "test")
    assert mapped.cached
    np.testing.assert_array_equal(mapped.array((4, 8), np.float32, None), np.ones((4, 8), np.float32))
    with pytest.raises(StaleEntry, match="this build asks for"):
        mapped.array((16,), np.float32, None)
    short = WeightCache("k" * 32, tmp_path).arena("x", 1024, "test")
    short.array((4, 8), np.float32, None)
    with pytest.raises(StaleEntry, match="holds 2 arrays"):
        short.finish()


def test_old_entries_are_pruned(tmp_path):
    for index in range(prepared.KEEP + 2):
        cache = WeightCache(f"{index:032d}", tmp_path)
        arena = cache.arena("x", 64, "test")
        arena.array((4,), np.float32, lambda out: out.fill(index))
        cache.save("x", arena)
        os.utime(tmp_path / "prepared" / f"{index:032d}-x.bin", ns=(index * 10**9, index * 10**9))
    kept = sorted(f.name[:32] for f in (tmp_path / "prepared").iterdir())
    assert kept == [f"{index:032d}" for index in range(2, prepared.KEEP + 2)]


def test_cli_says_it_builds_the_cache_once(folders):
    """After a cache wipe the first ``inference.py --stream`` says in one line that it prepares the cache; the
    next says nothing of it; both report the first audio since the synthesis and since the process started."""
    model, codec, cache = folders
    command = [sys.executable, "inference.py", "--model", str(model), "--codec", str(codec), "--device", "cpu",
               "--text", "Hello.", "--greedy", "--max-new-frames", "4", "--stream", "--quiet", "--no-wetext"]
    runs = []
    for index in range(2):
        done = subprocess.run(command + ["--output", str(cache.parent / f"{index}.wav")], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert done.returncode == 0, done.stderr
        assert "first audio after" in done.stdout and "s after the process started" in done.stdout
        runs.append(done.stderr.count(PREPARING))
    assert runs == [1, 0]
