"""``moss_npu.hub``: model folders and hub ids, and ``python -m moss_npu.hub download`` (no network used)."""

import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from moss_npu import hub
from moss_npu.errors import CheckpointError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_download(monkeypatch):
    """Replace huggingface_hub.snapshot_download; record its calls, create the folder it would fill."""
    calls = []

    def snapshot_download(repo_id, local_dir=None, allow_patterns=None, revision=None):
        calls.append(dict(repo_id=repo_id, local_dir=local_dir, allow_patterns=allow_patterns, revision=revision))
        folder = Path(local_dir) if local_dir else Path("/nonexistent-cache")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text("{}")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_download_command_fills_the_folder(tmp_path, capsys, fake_download):
    target = tmp_path / "models" / "nano"
    assert hub.main(["download", "OpenMOSS-Team/MOSS-TTS", str(target), "--include", "config.json"]) == 0
    assert fake_download == [dict(repo_id="OpenMOSS-Team/MOSS-TTS", local_dir=target, allow_patterns=["config.json"],
                                  revision=None)]
    assert capsys.readouterr().out == f"downloaded OpenMOSS-Team/MOSS-TTS to {target}\n"


@pytest.mark.parametrize("argv,fragment", [
    (["download", "not-an-id", "d"], "not a hub id"),
    (["download", "a/b"], "required: folder"),
    (["fetch", "a/b", "d"], "invalid choice"),
])
def test_download_usage_errors_are_one_line(tmp_path, capsys, argv, fragment):
    assert hub.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err


def test_download_into_a_file_is_refused(tmp_path, capsys, fake_download):
    (tmp_path / "f").write_text("x")
    assert hub.main(["download", "a/b", str(tmp_path / "f")]) == 2
    assert "is not a folder" in capsys.readouterr().err and fake_download == []


def test_offline_failure_names_the_variable_and_our_command(monkeypatch):
    def offline(**kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set") as info:
        hub.resolve_model_dir("OpenMOSS-Team/MOSS-TTS-Nano")
    assert "`python -m moss_npu.hub download OpenMOSS-Team/MOSS-TTS-Nano DIR`" in str(info.value)


def test_network_failure_is_a_runtime_failure(monkeypatch, capsys):
    def unreachable(**kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert hub.main(["download", "a/b", "dir"]) == 1
    assert "download failed (ConnectionError)" in capsys.readouterr().err


def test_missing_codec_folder_names_the_codec(tmp_path):
    with pytest.raises(CheckpointError, match=f"codec folder {tmp_path / 'c'} does not exist.*{hub.DEFAULT_CODEC}"):
        hub.resolve_model_dir(tmp_path / "c", role="codec", example=hub.DEFAULT_CODEC)


def test_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "moss_npu.hub", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "download" in done.stdout


def test_no_hint_names_a_command_that_may_not_exist():
    """`huggingface-cli` is gone from current huggingface_hub releases: no hint may name it."""
    for path in [*REPO.glob("moss_npu/**/*.py"), REPO / "README.md", REPO / "inference.py", REPO / "eval_accuracy.py"]:
        assert "huggingface-cli" not in path.read_text(encoding="utf-8"), path
