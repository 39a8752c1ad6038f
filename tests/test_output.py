"""``moss_npu.output``: format by extension, regular files only (symlinks written through), atomic writes."""

import os
import stat

import numpy as np
import pytest
import soundfile
import torch

from moss_npu import output
from moss_npu.audio import read_audio
from moss_npu.errors import InputError, OutputError
from moss_npu.output import AtomicAudioWriter, audio_target, save_audio, write_wav
from tests.optional import missing


def test_wav_is_float32_and_unclipped_by_default(tmp_path):
    wave = torch.tensor([[0.5, -1.5, 2.0], [0.0, 1e-7, -0.25]])
    path = save_audio(tmp_path / "out.wav", wave, 48000)
    info = soundfile.info(str(path))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "FLOAT", 48000, 2)
    assert torch.equal(read_audio(path)[0], wave)
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]


@pytest.mark.parametrize("name,fmt,subtype", [
    ("a.flac", "FLAC", "PCM_24"), ("a.ogg", "OGG", "VORBIS"), ("a.opus", "OGG", "OPUS"),
    ("a.mp3", "MP3", "MPEG_LAYER_III"), ("A.WAV", "WAV", "FLOAT"),
])
def test_format_follows_the_extension(tmp_path, name, fmt, subtype):
    if subtype not in soundfile.available_subtypes(fmt):
        missing(f"libsndfile {soundfile.__libsndfile_version__} cannot write {fmt}/{subtype}")
    t = torch.arange(48000) / 48000
    wave = torch.stack([torch.sin(2 * torch.pi * 440 * t), torch.sin(2 * torch.pi * 220 * t)]) * 0.5
    path = save_audio(tmp_path / name, wave, 48000)
    info = soundfile.info(str(path))
    assert (info.format, info.subtype, info.samplerate, info.channels) == (fmt, subtype, 48000, 2)
    assert abs(info.frames - 48000) < 4000  # lossy encoders pad a little


def test_wav_subtype_pcm16_clips(tmp_path):
    path = save_audio(tmp_path / "p.wav", torch.tensor([[0.5, 2.0, -3.0]]), 24000, wav_subtype="PCM_16")
    assert soundfile.info(str(path)).subtype == "PCM_16"
    data, _ = soundfile.read(str(path), dtype="float32")
    assert np.allclose(data, [0.5, 32767 / 32768, -1.0], atol=1e-4)


@pytest.mark.parametrize("name,subtype,fragment", [
    ("a.txt", None, "unknown audio extension .txt"),
    ("noext", None, "unknown audio extension (none)"),
    ("a.flac", "PCM_16", "only applies to .wav"),
    ("a.wav", "ULAW", "use one of"),
])
def test_unknown_extension_or_subtype_is_refused(tmp_path, name, subtype, fragment):
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        audio_target(tmp_path / name, subtype)


def test_opus_refuses_rates_it_cannot_store(tmp_path):
    target = audio_target(tmp_path / "a.opus")
    with pytest.raises(InputError, match="44100 Hz"):
        save_audio(target.path, torch.zeros(1, 100), 44100, target=target)
    assert list(tmp_path.iterdir()) == []


def test_only_regular_files_are_written(tmp_path):
    (tmp_path / "dir.wav").mkdir()
    os.mkfifo(tmp_path / "fifo.wav")
    with pytest.raises(InputError, match="is a folder"):
        audio_target(tmp_path / "dir.wav")
    with pytest.raises(InputError, match="is a FIFO"):
        audio_target(tmp_path / "fifo.wav")
    with pytest.raises(InputError, match="is a device file"):
        audio_target("/dev/null")
    (tmp_path / "null.wav").symlink_to("/dev/null")
    with pytest.raises(InputError, match="is a device file"):
        audio_target(tmp_path / "null.wav")
    with pytest.raises(InputError, match="does not exist"):
        audio_target(tmp_path / "no" / "x.wav")
    (tmp_path / "loop.wav").symlink_to(tmp_path / "loop.wav")
    with pytest.raises(InputError, match="symlink loop"):
        audio_target(tmp_path / "loop.wav")


def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.wav"
    real.write_bytes(b"old")
    link = tmp_path / "link.wav"
    link.symlink_to(real)
    save_audio(link, torch.zeros(1, 10), 48000)
    assert link.is_symlink() and soundfile.info(str(real)).frames == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav", "real.wav"]


def test_read_only_file_is_refused(tmp_path, monkeypatch):
    """Root may write anywhere, so the permission answer is simulated."""
    (tmp_path / "ro.wav").write_bytes(b"x")
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)
    with pytest.raises(InputError, match="read-only"):
        audio_target(tmp_path / "ro.wav")


def test_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "out.wav"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with AtomicAudioWriter(audio_target(target), 48000, 2) as writer:
            writer.write(torch.zeros(2, 4800))
            raise RuntimeError("generation failed mid-stream")
    with pytest.raises(InputError):
        save_audio(tmp_path / "bad.wav", torch.zeros(2, 2, 2), 48000)
    with pytest.raises(KeyboardInterrupt):  # what a signal becomes under moss_npu.cli
        with AtomicAudioWriter(audio_target(target), 48000, 2) as writer:
            writer.write(torch.zeros(2, 4800))
            raise KeyboardInterrupt
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.wav"]


def test_full_disk_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    """libsndfile reports ENOSPC as a bare "System error"; the writer names it from the free space."""
    class FullVfs:
        f_bavail, f_frsize = 0, 4096

    writer = AtomicAudioWriter(audio_target(tmp_path / "o.wav"), 48000, 2)

    def fail(frames):
        raise soundfile.LibsndfileError(2)

    monkeypatch.setattr(writer._file, "write", fail)
    monkeypatch.setattr(output.os, "statvfs", lambda path: FullVfs())
    with pytest.raises(OutputError, match=f"no space left writing {tmp_path / 'o.wav'}"):
        with writer:
            writer.write(torch.zeros(2, 100))
    assert list(tmp_path.iterdir()) == []
    assert OutputError.exit_code == 1


def test_streaming_writer_appends_chunks(tmp_path):
    chunks = [torch.randn(2, n) for n in (3840, 7680, 100)]
    with AtomicAudioWriter(audio_target(tmp_path / "s.wav"), 48000, 2) as writer:
        for chunk in chunks:
            writer.write(chunk)
            assert not (tmp_path / "s.wav").exists()  # appears only when complete
    assert writer.samples_written == 11620
    assert torch.equal(read_audio(tmp_path / "s.wav")[0], torch.cat(chunks, dim=1))


def test_written_file_is_an_ordinary_readable_file(tmp_path):
    """mkstemp creates 0600 files; the published audio must not keep that mode."""
    out = save_audio(tmp_path / "o.wav", torch.zeros(2, 10), 48000)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_write_wav_ignores_the_name(tmp_path):
    """The official code's torchaudio.save stand-in writes float WAV whatever the file is called."""
    path = write_wav(tmp_path / "odd.name", torch.zeros(1, 10), 16000)
    assert soundfile.info(str(path)).format == "WAV"


def test_a_folder_that_refuses_new_files_is_found_before_any_work(tmp_path, monkeypatch):
    """Read-only mounts and /proc pass the permission check; creating a file there is the real test."""
    import errno

    def refuse(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(output.tempfile, "mkstemp", refuse)
    with pytest.raises(InputError, match="cannot create files in .*Read-only file system"):
        audio_target(tmp_path / "o.wav")
    assert list(tmp_path.iterdir()) == []
