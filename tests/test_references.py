"""Every document the repository cites is in the repository: a file named `something.md`, a section
`docs/x.md §5.3` (which must exist as a numbered heading), a relative Markdown link. Someone who clones
the repository can follow every reference."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg", ".proto", ".jinja", ".json", ""}
# third-party manifests, kept as published; this file, whose examples are references on purpose
SKIP = ("k8s/vendor/", "tests/test_references.py")
DOC = re.compile(r"(?<![\w/.-])((?:\.\.?/)?[\w./-]*[\w-]\.md)\b")
SECTION = re.compile(r"([\w./-]+\.md)\)?\s*§\s*(\d+(?:\.\d+)*)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if not f.startswith(SKIP) and Path(f).suffix in TEXT_SUFFIXES
            and (ROOT / f).is_file()]


def _resolve(name: str, source: str) -> Path | None:
    """A cited path, relative to the citing file's folder or to the repository's root."""
    for base in (ROOT / source).parent, ROOT:
        path = (base / name).resolve()
        if path.is_file() and ROOT in path.parents:
            return path
    return None


def _headings(doc: Path) -> set[str]:
    return {m.group(1).rstrip(".") for m in re.finditer(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", doc.read_text(), re.M)}


def _problems(source: str) -> list[str]:
    try:
        text = (ROOT / source).read_text()
    except UnicodeDecodeError:
        return []
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{source}:{number}"
        for name in DOC.findall(line):
            if _resolve(name, source) is None:
                found.append(f"{where}: cites {name}, which is not in the repository")
        for name, section in SECTION.findall(line):
            doc = _resolve(name, source)
            if doc is not None and section not in _headings(doc):
                found.append(f"{where}: cites {name} §{section}, which has no such numbered section")
        if source.endswith(".md"):
            for target in LINK.findall(line):
                if "://" not in target and not target.startswith("mailto:") and _resolve(target, source) is None:
                    found.append(f"{where}: links to {target}, which is not in the repository")
    return found


def test_every_cited_document_is_in_the_repository():
    problems = [p for source in _files() for p in _problems(source)]
    assert not problems, "references to documents outside the repository:\n" + "\n".join(problems)


def test_the_check_catches_what_it_should(tmp_path, monkeypatch):
    """The patterns above find the kinds of reference they are meant for."""
    assert DOC.findall("see ABSENT.md §5 and nowhere/absent.md, not docs/mechanism.md") == \
        ["ABSENT.md", "nowhere/absent.md", "docs/mechanism.md"]
    assert SECTION.findall("(docs/mechanism.md §5.3) and [mechanism.md](mechanism.md) §8") == \
        [("docs/mechanism.md", "5.3"), ("mechanism.md", "8")]
    assert "5.3" in _headings(ROOT / "docs" / "mechanism.md") and "9" in _headings(ROOT / "docs" / "mechanism.md")
    assert _resolve("mechanism.md", "docs/design.md") is not None
    assert _resolve("mechanism.md", "raincheck_core/config.py") is None
