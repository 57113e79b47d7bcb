"""The README's relative links reach a file that exists and, with an anchor, a heading of it
(mkdocs checks the links inside docs/; the README is outside the site), and the site's home
page is the README. No network."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """The anchor of a heading as Python-Markdown's toc extension (mkdocs) makes it, which
    equals GitHub's for headings of letters, digits, spaces, dashes and apostrophes."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    prose = FENCE.sub("", markdown)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.MULTILINE)}


def relative_links(markdown: str) -> list[str]:
    prose = FENCE.sub("", markdown)
    prose = re.sub(r"`[^`\n]*`", "", prose)  # code spans are no links
    return [
        target
        for target in LINK.findall(prose)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


HOME_NOTE = "<!-- The site's home page: the README with its links made relative to docs/. -->"
SITE_NOTE = (
    "The `docs/` folder is also a website: `pip install -e '.[docs]' && mkdocs serve`.",
    "These pages are built from the repository's `docs/` folder: `pip install -e '.[docs]' && "
    "mkdocs serve` serves them locally.",
)


def site_home(readme: str) -> str:
    """docs/index.md: the README with its links into docs/ made relative to docs/."""
    home = readme.replace("](docs/", "](").replace(*SITE_NOTE)
    return home.replace("# exo\n", f"# exo\n\n{HOME_NOTE}\n", 1)


def test_the_site_home_page_is_the_readme() -> None:
    expected = site_home((ROOT / "README.md").read_text())
    assert (ROOT / "docs" / "index.md").read_text() == expected, (
        "docs/index.md differs from the README: run `python tests/test_readme_links.py`"
    )


def test_the_slug_of_a_heading_matches_mkdocs() -> None:
    assert slug("exo's kernels") == "exos-kernels"
    assert slug("The speed-targets suite") == "the-speed-targets-suite"
    assert slug("Comparing with llama.cpp") == "comparing-with-llamacpp"
    assert slug("`exo bench`") == "exo-bench"


def test_every_relative_link_of_the_readme_reaches_its_file_and_heading() -> None:
    readme = (ROOT / "README.md").read_text()
    links = relative_links(readme)
    assert len(links) > 10, links  # the README links into docs/
    broken = []
    for target in links:
        path_text, _, anchor = target.partition("#")
        path = (ROOT / path_text) if path_text else ROOT / "README.md"
        if not path.is_file():
            broken.append(f"{target}: no file {path.relative_to(ROOT)}")
        elif anchor and anchor not in anchors(path.read_text()):
            broken.append(f"{target}: {path.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "broken links in README.md:\n" + "\n".join(broken)


if __name__ == "__main__":  # rewrite docs/index.md from the README
    (ROOT / "docs" / "index.md").write_text(site_home((ROOT / "README.md").read_text()))
