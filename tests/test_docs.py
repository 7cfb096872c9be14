"""The documentation: the site builds from docs/ with no warning (`make docs` in strict
mode), and every relative link of README.md and docs/ names a file (and heading) that
exists.

mkdocs checks links between the site's pages and their anchors; the README is not part of
the site, and a page may name a file of the repository outside docs/, so those links are
checked here against the working tree."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore")
    words = re.sub(r"[^\w\s-]", "", text.decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", words)


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor do code spans
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (the dev extra installs it: pip install -e '.[dev]')",
)
def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "api" / "index.html").is_file()


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_relative_link_names_a_file_and_anchor_that_exist(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        found = (path.parent / file).resolve()
        if not found.exists() or (
            anchor and found.suffix == ".md" and anchor not in anchors(found)
        ):
            broken.append(target)
    assert not broken, f"{path.name} links to what does not exist: {broken}"


def test_every_page_is_in_the_site_s_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if f": {p.name}" not in config]
    assert not missing, f"pages outside mkdocs.yml's nav: {missing}"


def test_the_readme_fits_on_one_screen_and_points_nowhere_outside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    for path in [ROOT / "README.md", *PAGES]:
        text = path.read_text()
        assert not re.search(r"sha[r]ed/|[A-Z]+\.md\b(?<!README\.md)", text), path.name
