"""Code and docs cite files of this repository only; docs/design.md is the design of record.

Every text file of the repository (tracked, or untracked and not ignored) is scanned:
none may name the design brief or the reference papers kept outside the repository, or
a path into the folder beside it; every `docs/design.md section N` names a section the
design has; every relative Markdown link resolves to one of those files or folders.
"""

import os
import re
import subprocess
from pathlib import PurePosixPath

from tests import paths

REPO = str(paths.REPO)
DESIGN = "docs/design.md"

# What points outside the repository. Each pattern is spelled so that it does not match
# its own source text (this file is scanned too).
OUTSIDE = re.compile(
    r"\bDESIGN\.md\b"  # the starting brief; the design of record is docs/design.md
    r"|\.\./shared\b"  # the folder beside a checkout
    r"|/wor[k]/shared\b"  # the same folder, absolute
    r"|\bpapers/[\w.-]+\.txt\b"  # the reference papers: cite them by title
)
DESIGN_CITATION = re.compile(r"docs/design\.md,? (?:sections? |§ ?)(\d+(?:(?:, | and | or )\d+)*)")
DESIGN_SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def outside_citations(text: str) -> list[str]:
    """Each line of `text` that cites a path outside the repository, as 'LINE: text'."""
    return [
        f"{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]


def cited_design_sections(text: str) -> set[int]:
    """The section numbers `text` cites as `docs/design.md section N` (or `sections N and M`)."""
    return {
        int(number)
        for match in DESIGN_CITATION.finditer(text)
        for number in re.findall(r"\d+", match.group(1))
    }


def _repository_files() -> list[str]:
    """What `git` holds or would add: tracked files, and untracked ones not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    return [name for name in listed.decode().split("\0") if name]


def _tracked_texts() -> dict[str, str]:
    texts = {}
    for name in _repository_files():
        path = os.path.join(REPO, name)
        if not os.path.isfile(path):  # deleted in the work tree, not yet committed
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # images, golden binaries: they cite nothing
    return texts


def test_the_patterns_tell_outside_paths_from_repository_paths():
    brief = "DESIGN" + ".md"
    assert outside_citations(f"see {brief} section 5\nfine") == [f"1: see {brief} section 5"]
    assert outside_citations("(`.." + "/shared/README`)")
    assert outside_citations("/work" + "/shared/")
    assert outside_citations("the paper (" + "pap" + "ers/dp-fedemb.txt)")
    assert not outside_citations("docs/design.md section 5; [README](../README.md)")
    assert not outside_citations("shared negatives; shared_negatives.py; ../../etc/passwd")
    cited = "(docs/design.md sections 1 and 8), docs/design.md §2, docs/design.md"
    assert cited_design_sections(cited) == {1, 2, 8}


def test_no_file_cites_a_path_outside_the_repository():
    found = [
        f"{name}:{where}"
        for name, text in sorted(_tracked_texts().items())
        for where in outside_citations(text)
    ]
    assert not found, (
        "cite repository paths only (the design is docs/design.md; name a paper by its "
        "title):\n" + "\n".join(found)
    )


def test_every_design_citation_names_a_section_of_the_design():
    texts = _tracked_texts()
    sections = {int(n) for n in DESIGN_SECTION.findall(texts[DESIGN])}
    assert sections == set(range(1, len(sections) + 1)), f"{DESIGN}: sections {sorted(sections)}"
    wrong = [
        f"{name}: section {number}"
        for name, text in sorted(texts.items())
        for number in sorted(cited_design_sections(text) - sections)
    ]
    assert not wrong, f"{DESIGN} has sections 1-{len(sections)}:\n" + "\n".join(wrong)


def test_every_relative_markdown_link_resolves_inside_the_repository():
    tracked = _repository_files()
    folders = {str(parent) for name in tracked for parent in PurePosixPath(name).parents}
    targets = set(tracked) | folders
    broken = []
    for name, text in sorted(_tracked_texts().items()):
        if not name.endswith(".md"):
            continue
        for link in MARKDOWN_LINK.findall(text):
            target = link.split("#", 1)[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(name), target))
            if resolved.startswith("..") or resolved not in targets:
                broken.append(f"{name}: ({link})")
    assert not broken, "links to nothing in the repository:\n" + "\n".join(broken)
