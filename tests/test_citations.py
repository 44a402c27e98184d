"""The code stands on its own: every document it cites ships in docs/, with the cited section.

Citations take the form ``docs/NAME.md`` optionally followed by sections, ``docs/kareus.md §5.4``
or ``docs/perseus.md §5.3, §5.6``. A citation of a note that the repository does not ship (the
names the project's early code cited, without ``docs/``) is an error too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("powerlib", "backends", "integrations", "benchmarks", "examples", "tests", "docs")
# Built by concatenation so that this file does not cite them itself.
UNSHIPPED = tuple(n + ".md" for n in ("kareus", "perseus", "peers", "integrations", "hal"))
UNSHIPPED += tuple(n.upper() + ".md" for n in ("design", "style"))

CITATION = re.compile(r"docs/([A-Za-z0-9_-]+\.md)((?:,? ?§\d+(?:\.\d+)*)*)")
BARE = re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in UNSHIPPED) + r")\b")
HEADING = re.compile(r"^#+\s+(\d+(?:\.\d+)*)\b", re.M)


def _files(root: Path) -> list[Path]:
    found = [root / "README.md"] if (root / "README.md").exists() else []
    for folder in SCANNED:
        base = root / folder
        if base.is_dir():
            found += sorted(p for p in base.rglob("*") if p.suffix in (".py", ".md", ".toml"))
    return [p for p in found if p.resolve() != Path(__file__).resolve()]  # the checker's fixtures


def citation_problems(root: Path = ROOT) -> list[str]:
    """One line per citation of a missing document or section, or of an unshipped note."""
    sections: dict[str, set[str] | None] = {}
    problems = []
    for path in _files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(root)}:{number}"
            for match in BARE.finditer(line) if path.parts[-2:-1] != ("docs",) else ():
                if line[: match.start()].endswith("docs/"):
                    continue  # a shipped note of the same name
                problems.append(
                    f"{where}: cites {match.group(1)}, which the repository does not ship"
                )
            for match in CITATION.finditer(line):
                name = match.group(1)
                if name not in sections:
                    doc = root / "docs" / name
                    sections[name] = (
                        set(HEADING.findall(doc.read_text(encoding="utf-8")))
                        if doc.is_file()
                        else None
                    )
                have = sections[name]
                if have is None:
                    problems.append(f"{where}: cites docs/{name}, which does not exist")
                    continue
                for section in re.findall(r"§(\d+(?:\.\d+)*)", match.group(2)):
                    if section not in have:
                        problems.append(
                            f"{where}: cites docs/{name} §{section}, which has no such section"
                        )
    return problems


def test_every_cited_document_and_section_ships() -> None:
    assert citation_problems() == []


def test_the_checker_reports_missing_documents_sections_and_unshipped_notes(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("# Notes\n\n## 2 Model\n\n### 2.1 Options\n")
    (tmp_path / "powerlib").mkdir()
    (tmp_path / "powerlib" / "a.py").write_text(
        '"""See docs/notes.md §2.1, §2.2 and docs/gone.md."""\n'
        f"# the energy model ({UNSHIPPED[0]} §1.4)\n"
        f"# see ../shared/reference/{UNSHIPPED[1]}\n"
        "# fine: docs/notes.md §2\n"
    )
    assert citation_problems(tmp_path) == [
        "powerlib/a.py:1: cites docs/notes.md §2.2, which has no such section",
        "powerlib/a.py:1: cites docs/gone.md, which does not exist",
        f"powerlib/a.py:2: cites {UNSHIPPED[0]}, which the repository does not ship",
        f"powerlib/a.py:3: cites {UNSHIPPED[1]}, which the repository does not ship",
    ]
