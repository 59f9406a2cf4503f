"""The repository's documentation stays followable: every citation resolves inside the repository.

- no internal counters: no "session N" anywhere, no result directory named `..._sNN`;
- no citation of the design brief that lives outside the repository;
- the README stays a newcomer's page (under 200 lines);
- every relative Markdown link in README.md, docs/ and benchmarks/ resolves to a file here;
- every topic citation (`NOTES.md "Lean layer"`) names a `##` heading of benchmarks/NOTES.md, and
  every log citation (`LOG.md 2026-11-26 "The small GPU chooses for itself"`, or the date and
  title alone inside NOTES.md and LOG.md) names an entry of benchmarks/LOG.md by its date and
  the start of its title.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "benchmarks" / "NOTES.md"
LOG = ROOT / "benchmarks" / "LOG.md"
OUTSIDE_BRIEF = "DESIGN" + ".md"     # spelled apart so this file does not cite it
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "runs", ".pytest_cache"}


def tracked_files() -> list[Path]:
    """The repository's files: git's list where there is one, else a walk that skips build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*")
                if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None                  # binary (plots) or gone


def text_files() -> dict[Path, str]:
    texts = {}
    for p in tracked_files():
        t = text_of(p)
        if t is not None:
            texts[p] = t
    return texts


def flattened(path: Path, text: str) -> str:
    """One line of text: a citation broken across lines (and comment markers in Python) reads whole."""
    if path.suffix == ".py":
        text = re.sub(r"\n\s*#\s*", " ", text)
    return re.sub(r"\s+", " ", text)


def test_no_session_counters_anywhere():
    hits = [f"{p.relative_to(ROOT)}:{t.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for p, t in text_files().items()
            for m in re.finditer(r"(?i)\bsessions?[\s-]+\d", t)]
    assert not hits, "internal counters; write a date or a NOTES.md topic instead:\n" + "\n".join(hits)


def test_no_citation_of_a_file_outside_the_repository():
    hits = [str(p.relative_to(ROOT)) for p, t in text_files().items() if OUTSIDE_BRIEF in t]
    assert not hits, f"{OUTSIDE_BRIEF} is not in the repository; cite docs/contract.md: {hits}"


def test_result_directories_are_named_by_what_they_measure():
    counters = [str(p.relative_to(ROOT)) for p in tracked_files()
                if "results" in p.relative_to(ROOT).parts
                and re.search(r"(_s\d+(/|\.|_|$))|(/s\d+/)", p.relative_to(ROOT).as_posix())]
    assert not counters, "result paths carrying a counter:\n" + "\n".join(counters[:20])


def test_readme_is_a_short_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n < 200, f"README.md has {n} lines; engine internals belong in docs/"


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in markdown_pages():
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue             # a URL or an anchor on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not broken, "links to files that are not in the repository:\n" + "\n".join(broken)


def notes_topics() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^## (.+)$", NOTES.read_text(), re.M)}


def log_entries() -> list[tuple[str, str]]:
    entries = [(m.group(1), m.group(2).strip())
               for m in re.finditer(r"^## (\d{4}-\d\d-\d\d) · (.+)$", LOG.read_text(), re.M)]
    return [(d, re.sub(r"\s+", " ", title)) for d, title in entries]


def test_notes_is_a_reference_by_topic_and_the_log_is_dated():
    topics = notes_topics()
    assert {"Host AdamW", "Lean layer", "Disk tier", "Data parallel", "Memory fit margins"} <= topics
    assert not [t for t in topics if re.match(r"\d", t)], "NOTES.md topics are names, not numbers"
    dates = [d for d, _ in log_entries()]
    assert dates and dates == sorted(dates), "LOG.md entries are dated, oldest first"
    headings = re.findall(r"^## .+$", LOG.read_text(), re.M)
    assert len(headings) == len(dates), "every LOG.md entry is headed `## YYYY-MM-DD · Title`"


def test_notes_citations_name_a_topic():
    topics = notes_topics()
    cited, unknown = 0, []
    for p, t in text_files().items():
        rel = p.relative_to(ROOT)
        if rel.parts[0] not in ("src", "tests", "docs", "benchmarks") and rel.name != "README.md":
            continue
        if p == Path(__file__).resolve():
            continue                 # its own messages quote the pattern
        for m in re.finditer(r'NOTES\.md`?,? \\?"([^"\\]+)\\?"', flattened(p, t)):
            cited += 1
            if m.group(1) not in topics:
                unknown.append(f"{rel}: NOTES.md \"{m.group(1)}\"")
    assert cited > 20, "the code cites NOTES.md by topic"
    assert not unknown, "citations of NOTES.md topics that do not exist:\n" + "\n".join(unknown)


def test_no_citation_by_section_number():
    hits = []
    for p, t in text_files().items():
        rel = p.relative_to(ROOT)
        for m in re.finditer(r"NOTES(\.md)?`?\)?,? (sections? )?\d", flattened(p, t)):
            hits.append(f"{rel}: {m.group(0)!r}")
    assert not hits, "NOTES.md is cited by topic (or LOG.md by date), not by number:\n" + "\n".join(hits)


def test_log_citations_name_an_entry():
    entries = log_entries()
    cited, unknown = 0, []
    for p, t in text_files().items():
        in_benchmark_docs = p in (NOTES, LOG)
        pattern = r'(\d{4}-\d\d-\d\d) \\?"([^"\\]+)\\?"' if in_benchmark_docs else r'LOG\.md`? (\d{4}-\d\d-\d\d) \\?"([^"\\]+)\\?"'
        for m in re.finditer(pattern, flattened(p, t)):
            date, title = m.groups()
            cited += 1
            if not any(d == date and title in heading for d, heading in entries):
                unknown.append(f"{p.relative_to(ROOT)}: {date} \"{title}\"")
    assert cited > 50
    assert not unknown, "citations of LOG.md entries that do not exist:\n" + "\n".join(unknown)


def _layout_modules() -> set[str]:
    """The modules docs/layout.md's tree names, as paths under src/ (its indentation is the nesting)."""
    block = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    named, folders = set(), []                     # folders: (indent, "name/") from the root down
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+\.py|\S+/)(?:\s|$)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if name.endswith("/"):
            folders.append((indent, name))
        else:
            named.add("".join(f for _, f in folders) + name)
    return named


def test_layout_names_every_module():
    """docs/layout.md lists every module of src/slidetune (package __init__ files aside) where it
    is, and no module that is gone."""
    tree = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "slidetune").rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}
    named = {n.removeprefix("src/") for n in _layout_modules() if n.startswith("src/slidetune/")}
    assert not tree - named, f"modules docs/layout.md does not list: {sorted(tree - named)}"
    assert not named - tree, f"docs/layout.md lists modules that do not exist: {sorted(named - tree)}"
