"""The docs: the README fits a screen and every link in it reaches a page; the docs site (mkdocs.yml, MkDocs with
the Material theme) builds with warnings as errors, the way `make docs` builds it, and its navigation lists every
page under docs/; a broken link fails the build."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = [sys.executable, "-m", "mkdocs"]
README_LINES = 150


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_readme_fits_a_screen_and_its_links_reach_pages():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, len(text.splitlines())
    assert text.startswith("# cancelwatch\n\n```sh\nmake demo ") and "\nmake test " in text.split("```", 2)[1]
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((ROOT / link).is_file() for link in links), [x for x in links if not (ROOT / x).is_file()]
    # the four verdicts and the five timepoints are named where a reader starts
    for word in ("released", "leaked", "stale_gauge", "inconclusive", "user_stop", "app_received", "engine_abort",
                 "left_scheduler", "reusable", "rule"):
        assert f"`{word}`" in text, word
    assert "report --json`" in text


def test_the_docs_build_strict_and_list_every_page(tmp_path):
    res = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "rules" / "index.html").is_file()
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert set(nav_pages(config["nav"])) == pages, sorted(pages ^ set(nav_pages(config["nav"])))


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "hops.md").write_text((docs / "hops.md").read_text() + "\nSee [a page that is not there](nowhere.md).\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    res = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0 and "nowhere.md" in res.stdout + res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
