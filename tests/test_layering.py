"""Imports point down: dashboard/notebooks -> analysis -> runstore; collectors -> runstore. Nothing imports dashboard."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "runstore": {"collectors", "analysis", "dashboard"},
    "analysis": {"collectors", "dashboard", "streamlit", "httpx", "pynvml", "psutil"},
    "collectors": {"dashboard"},
    # the dashboard reads runs: it never samples, drives or starts anything
    "dashboard": {"collectors", "httpx", "pynvml", "psutil"},
    "notebooks": {"collectors", "dashboard", "httpx", "pynvml", "psutil"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_point_down():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            hits = imported_top_levels(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, bad


def test_nvml_is_quarantined():
    users = [p.relative_to(ROOT) for p in (ROOT / "collectors").rglob("*.py") if "pynvml" in imported_top_levels(p)]
    assert [str(p) for p in users] == ["collectors/nvml.py"]
