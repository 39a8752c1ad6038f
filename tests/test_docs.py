"""The README and docs/ hold what they promise: every cited document and section exists in this repository, and
the README's first command block is what .ci/run reads and runs anywhere."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import missing, require

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
# Documents that are not in the repository, which files used to cite ("spec §7", "design.md", ...).
FOREIGN = re.compile(r"spec §|§\s*\d|design\.md|nano_spec|delay_spec|style\.md|bench/README")
# A repository document named in code or prose: docs/<name>.md with an optional #section.
DOC_REF = re.compile(r"docs/([\w.-]+\.md)((?:#[\w-]+)?)")
# Markdown links: [text](target), for relative targets.
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked_text_files():
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        missing("not a git checkout: cannot list the repository's files")
    for name in listed.stdout.splitlines():
        path = REPO / name
        if path.suffix in (".py", ".md", ".c", ".yaml", ".yml", ".txt", ".toml", ".cfg") or name == ".ci/run":
            if path.is_file():
                yield path


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading anchor of a Markdown file (headings inside code blocks excluded)."""
    found, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_no_file_cites_a_document_outside_the_repository():
    offenders = [f"{p.relative_to(REPO)}:{n}: {line.strip()[:80]}"
                 for p in _tracked_text_files() if p.name != "test_docs.py"
                 for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
                 if FOREIGN.search(line)]
    assert not offenders, "cites a document that is not in the repository:\n" + "\n".join(offenders)


def test_every_docs_reference_names_an_existing_section():
    """``docs/<name>.md#section`` anywhere (docstrings, comments, Markdown) points at a real file and heading."""
    missing = []
    for path in _tracked_text_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name, anchor in DOC_REF.findall(line):
                doc = REPO / "docs" / name
                if not doc.is_file():
                    missing.append(f"{path.relative_to(REPO)}:{n}: docs/{name} does not exist")
                elif anchor and anchor[1:] not in anchors(doc):
                    missing.append(f"{path.relative_to(REPO)}:{n}: docs/{name} has no section {anchor}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", [REPO / "README.md", *DOCS], ids=lambda p: p.name)
def test_markdown_links_resolve(doc):
    """Relative links in the README and docs/ reach an existing file and, with #anchor, an existing heading."""
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_each_doc_says_how_to_reproduce_it(doc):
    """Every document ends its claims with the commands that check them: a heading naming reproduction."""
    text = doc.read_text(encoding="utf-8")
    assert re.search(r"^#+ .*reproduc", text, re.M | re.I), f"{doc.name}: no section saying how to reproduce it"


def first_bash_block() -> list[str]:
    """The README's first bash block, parsed as .ci/run parses it."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()


def readme_line(tag: str) -> str:
    """The command whose trailing comment starts with ``# tag`` (.ci/run's ``readme_line``)."""
    for line in first_bash_block():
        command, _, comment = line.partition("  #")
        if comment.strip().startswith(tag):
            return command.strip()
    raise AssertionError(f"README's first bash block has no line tagged '# {tag}'")


def test_readme_keeps_the_lines_ci_runs():
    assert "pip install" in readme_line("install") and "-e" in readme_line("install")
    assert "[llama]" in readme_line("optional")
    assert "pytest" in readme_line("run the tests")


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_readme_first_block_ends_with_a_command_for_any_machine():
    """A newcomer's first run must not be an error: the block's last line names no device only some have."""
    last = first_bash_block()[-1]
    assert last.startswith("python inference.py") and "--device auto" in last, last
    assert not re.search(r"--device (npu|cuda)", last), last


@pytest.fixture
def nano_tiny():
    from moss_npu_verify.goldens import fixtures_root

    root = fixtures_root() / "nano-tiny"
    if not (root / "cases.json").is_file():
        missing(f"nano-tiny fixture not found under {fixtures_root()}; set MOSS_NPU_FIXTURES")
    require("torch", "pip install torch==2.13.0")
    return root


def test_readme_speak_line_runs_on_this_machine(nano_tiny, tmp_path):
    """The first block's last line, given model folders (the tiny fixture's) and a frame cap, speaks here."""
    command = shlex.split(first_bash_block()[-1].partition("  #")[0])
    assert command[:2] == ["python", "inference.py"]
    out = tmp_path / "out.wav"
    args = [str(out) if a == "out.wav" else a for a in command[2:]]
    done = subprocess.run([sys.executable, "inference.py", *args, "--model", str(nano_tiny / "tts"),
                           "--codec", str(nano_tiny / "codec"), "--max-new-frames", "8", "--seed", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and out.stat().st_size > 44
