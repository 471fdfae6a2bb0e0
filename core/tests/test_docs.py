"""The README is a front page that stays true: every impl in its table, every link (README and docs/)
pointing at a file that exists, and short enough to be read (detail lives in docs/)."""

import re

import pytest

from distref.testing import ROOT

IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_page_listing_every_impl():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    listed = re.findall(r"^\| \[`(\w+)`\]\(impls/\1\)", readme, flags=re.MULTILINE)
    assert sorted(listed) == IMPLS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name
