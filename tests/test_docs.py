"""Every doc the code cites is in the repository, and says what the citation points at (docs/DESIGN.md,
"Conventions"): a `docs/X.md` / `README.md` path named in a module under hicache/ or tests/ exists, a
`docs/X.md, "Section"` citation names a heading of that doc, a `docs/X.md section N` citation its N-th
numbered section; and docs/LAYOUT.md's table names every package and module of the tree, and only
paths that exist."""

from __future__ import annotations

import pathlib
import re

import hicache
from hicache.errors import UserError

PACKAGE = pathlib.Path(hicache.__file__).parent
ROOT = PACKAGE.parent
CITING = (PACKAGE, ROOT / "tests")

# A path token ending in .md; those the repository must hold are the docs/ ones, DESIGN.md and README.md
# (a bare DESIGN.md resolves to nothing: the design doc lives in docs/).
MD_PATH = re.compile(r"(?<![\w./-])([\w./-]*\.md)\b")
# `docs/X.md, "A"` or `docs/X.md, "A" and "B"`; a name may wrap onto the next line of a docstring.
SECTION_CITATION = re.compile(r'(docs/[\w-]+\.md), ((?:"[^"]+"(?: and |, )?)+)')
NUMBERED_CITATION = re.compile(r"(docs/[\w-]+\.md),? section (\d+)")
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.MULTILINE)


def sources() -> list[pathlib.Path]:
    return [p for root in CITING for p in sorted(root.rglob("*.py")) if p != pathlib.Path(__file__)]


def normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def headings(doc: pathlib.Path) -> set[str]:
    titles = HEADING.findall(doc.read_text(encoding="utf-8"))
    return {normalized(t) for t in titles} | {normalized(re.sub(r"^\d+\.\s*", "", t)) for t in titles}


def where(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_cited_doc_exists():
    missing = []
    for path in sources():
        for cited in MD_PATH.findall(path.read_text(encoding="utf-8")):
            must_exist = cited.startswith("docs/") or pathlib.PurePath(cited).name in ("DESIGN.md", "README.md")
            if must_exist and not (ROOT / cited).is_file():
                missing.append(f"{where(path)}: {cited}")
    assert missing == []


def test_every_cited_section_is_a_heading_of_its_doc():
    unknown = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for doc, names in SECTION_CITATION.findall(text):
            if not (ROOT / doc).is_file():
                continue  # reported by test_every_cited_doc_exists
            known = headings(ROOT / doc)
            for name in re.findall(r'"([^"]+)"', names):
                if normalized(name) not in known:
                    unknown.append(f'{where(path)}: {doc}, "{name}"')
        for doc, number in NUMBERED_CITATION.findall(text):
            titles = HEADING.findall((ROOT / doc).read_text(encoding="utf-8")) if (ROOT / doc).is_file() else []
            if not any(t.startswith(f"{number}. ") for t in titles):
                unknown.append(f"{where(path)}: {doc} section {number}")
    assert unknown == []


def layout_rows() -> list[str]:
    readme = (ROOT / "docs" / "LAYOUT.md").read_text(encoding="utf-8")
    table = readme.split("\n## Layout\n", 1)[1].strip().split("\n\n", 1)[0]
    return [row for row in table.splitlines() if row.startswith("|")][2:]


def test_the_layout_names_every_package_and_module():
    named: set[str] = set()
    for row in layout_rows():
        where_column = row.rsplit("|", 2)[1]
        names = re.findall(r"`([\w./]+)`", where_column)
        packages = [n for n in names if n.startswith("hicache/") and n.endswith("/")]
        for name in names:
            if name.startswith("hicache/"):
                named.add(name)
            else:
                named.update(package + name for package in packages)
    modules = {where(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}  # a package's, by its folder
    packages = {where(p.parent) + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert sorted((modules | packages) - named) == []  # in the tree, not in the table
    assert sorted(n for n in named if not (ROOT / n).exists()) == []  # in the table, not in the tree


def test_the_flags_reference_is_rendered_from_the_parser():
    """docs/FLAGS.md is what `make docs` renders from the flag definitions: a flag added, renamed or given a
    new default without re-rendering fails here, so the reference cannot drift."""
    from hicache.cli_reference import render

    assert (ROOT / "docs" / "FLAGS.md").read_text(encoding="utf-8") == render(), "docs/FLAGS.md is stale: make docs"


def test_every_flag_says_what_it_does():
    from hicache.cli_reference import render

    silent = [row for row in render().splitlines() if row.startswith("| `") and row.endswith("|  |")]
    assert silent == []


def test_every_flag_a_doc_table_names_exists():
    """The hand-written flag tables (README, docs/USAGE.md, docs/SERVER.md) explain more than --help, so they
    stay; each flag a table row names must still be a flag of some `hicache` command."""
    from hicache.cli_reference import render

    known = set(re.findall(r"`(--[\w-]+)`", render()))
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for row in doc.read_text(encoding="utf-8").splitlines():
            if row.startswith("| `--"):
                stale += [
                    f"{doc.name}: {flag}" for flag in re.findall(r"`(--[\w-]+)", row.split("|")[1]) if flag not in known
                ]
    assert stale == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_lands_on_a_file_and_heading():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", doc.read_text(encoding="utf-8")):
            path = (doc.parent / target).resolve()
            if not path.is_file():
                broken.append(f"{doc.name}: {target}")
            elif anchor and anchor not in {slug(h) for h in HEADING.findall(path.read_text(encoding="utf-8"))}:
                broken.append(f"{doc.name}: {target}#{anchor}")
    assert broken == []


def test_every_hicache_command_line_in_the_docs_parses():
    """A command a reader copies from the README or docs/ is one the parser takes (flags renamed or removed
    since fail here); what it then does is the tests' business."""
    import shlex

    from hicache.cli import build_parser

    parser, wrong = build_parser(), []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(encoding="utf-8"), re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                if line.split(" ", 1)[0] not in ("hicache", ".venv/bin/hicache"):
                    continue  # curl and other programs
                words = shlex.split(line.split(" #")[0])
                try:
                    parser.parse_args(words[1:])
                except (UserError, SystemExit) as exc:
                    wrong.append(f"{doc.name}: {' '.join(words)}: {exc}")
    assert wrong == []
