"""The documentation's references hold: links resolve, and `benchmarks/results/` holds what it cites.

- Every relative link of README.md, CHANGELOG.md and docs/*.md names a file that exists, and its
  `#anchor`, if any, a heading of that page (GitHub's heading ids).
- Every path under `benchmarks/results/` that a page names in its prose exists (a `*` pattern must
  match a file; `{a,b}` and `x.json|md` name each alternative), and every file there is named by a
  page: the folder holds the results the docs quote, nothing else, and at most 40 files. Commands in code blocks may
  name files they would write, so code blocks are not read for either check.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MAX_RESULT_FILES = 40
LINKED_PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
CITING_PAGES = [*LINKED_PAGES, REPO / "benchmarks" / "README.md"]

LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULT_PATH = re.compile(r"benchmarks/results/([\w.{},*|-]+)")


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def heading_ids(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation dropped, spaces -> '-'."""
    ids = set()
    for line in prose(page).splitlines():
        if match := re.match(r"#+ (.*)", line):
            text = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            ids.add(text.replace(" ", "-"))
    return ids


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in heading_ids(file):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def alternatives(cited: str) -> list[str]:
    """`a-{x,y}.json|md` -> a-x.json, a-x.md, a-y.json, a-y.md."""
    names = [cited]
    while any("{" in name for name in names):
        expanded = []
        for name in names:
            if match := re.search(r"\{([^}]*)\}", name):
                for option in match.group(1).split(","):
                    expanded.append(name[: match.start()] + option + name[match.end() :])
            else:
                expanded.append(name)
        names = expanded
    out = []
    for name in names:
        first, *other_suffixes = name.split("|")
        out.append(first)
        stem = first.rsplit(".", 1)[0]
        out.extend(f"{stem}.{suffix}" for suffix in other_suffixes)
    return out


def cited_results(pages: list[Path]) -> tuple[set[str], list[str]]:
    """The result files the pages name, and what they name that does not exist."""
    present = sorted(p.name for p in RESULTS.iterdir())
    cited, missing = set(), []
    for page in pages:
        for raw in RESULT_PATH.findall(prose(page)):
            for name in alternatives(raw.rstrip(".,")):
                matched = fnmatch.filter(present, name) if "*" in name else [name]
                found = [m for m in matched if (RESULTS / m).is_file()]
                if not found:
                    missing.append(f"{page.name}: benchmarks/results/{name}")
                cited.update(found)
    return cited, missing


def test_every_relative_link_resolves():
    broken = [line for page in LINKED_PAGES for line in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_every_cited_result_exists():
    _, missing = cited_results(CITING_PAGES)
    assert not missing, "\n".join(missing)


def test_every_result_file_is_cited_by_a_page():
    cited, _ = cited_results(CITING_PAGES)
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in cited)
    assert not uncited, "cited by no page:\n" + "\n".join(uncited)


def test_the_results_folder_holds_at_most_40_files():
    """Older results are folded into rows of docs/benchmarks.md (figure, date, command, machine)
    rather than kept as files: the folder holds what the pages quote now."""
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= MAX_RESULT_FILES, f"{len(files)} files in benchmarks/results/"


def test_the_pattern_rules():
    assert alternatives("a-{x,y}.json|md") == ["a-x.json", "a-x.md", "a-y.json", "a-y.md"]
    assert alternatives("a.md") == ["a.md"]


def test_the_readme_is_a_quick_start_with_the_two_commands():
    """The README stays short (issue 38: at most 250 lines) and holds the set-up contract: the demo
    command and the test command on lines of their own, the latter exactly what `.ci/run` runs."""
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 250, f"README.md has {len(readme)} lines"
    assert "bash scripts/run.sh demo" in readme
    assert "bash scripts/run.sh test" in readme
    assert "exec bash scripts/run.sh test" in (REPO / ".ci" / "run").read_text().splitlines()
