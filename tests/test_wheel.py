"""The package as a user installs it: the wheel and the sdist build (python -m build) and pass `twine check`; the
wheel installed with no extras into a fresh venv brings none of the page's, the notebooks' or Triton's libraries,
runs `cancelwatch --help`, `watch --help` and a `report` of the sample run, and a command whose extra is missing
says the pip line that adds it (exit 2); with [dashboard] the page runs. Everything installs under `cancelwatch.`
and nothing else lands top-level. Its sizes are printed (-s)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cancelwatch import PARTS

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dashboard" / "sample" / "sample.db"
EXTRAS_ONLY = ("streamlit", "plotly", "tsdownsample", "papermill", "nbconvert", "jupyterlab", "tritonclient")

pytestmark = pytest.mark.timeout(900)


def run(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, timeout=timeout)


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


@pytest.mark.slow
def test_the_wheel_installs_slim_and_each_extra_adds_its_part(tmp_path):
    dist = tmp_path / "dist"
    built = run(sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel, sdist = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheel) == len(sdist) == 1, list(dist.iterdir())
    checked = run(sys.executable, "-m", "twine", "check", "--strict", str(wheel[0]), str(sdist[0]))
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr

    with zipfile.ZipFile(wheel[0]) as z:
        top = {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
        listed = z.namelist()
    assert top == {"cancelwatch"}, f"the wheel puts {sorted(top - {'cancelwatch'})} top-level"
    for part in PARTS:  # every module of the repository's parts, under cancelwatch/
        here = {str(p.relative_to(ROOT)) for p in (ROOT / part).rglob("*.py") if "__pycache__" not in p.parts}
        assert {f"cancelwatch/{p}" for p in here} <= set(listed), sorted(here - {n[12:] for n in listed})

    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    py, cw = venv / "bin" / "python", venv / "bin" / "cancelwatch"
    got = run(str(py), "-m", "pip", "install", "-q", str(wheel[0]))
    assert got.returncode == 0, got.stderr[-3000:]
    base_mb = size_mb(venv)
    present = run(str(py), "-c", "import importlib.util as u, sys; "
                                 f"print(*[m for m in {EXTRAS_ONLY!r} if u.find_spec(m)])").stdout.split()
    assert present == [], f"the base install brought {present}"
    away = tmp_path / "elsewhere"  # not the repository: what runs is the installed package
    away.mkdir()
    # the engine's own venv runs the relay app as cancelwatch.collectors.engines.relay_app from where the
    # package is installed: site-packages, not the package's own folder
    where = run(str(py), "-c", "import cancelwatch, pathlib\nfrom cancelwatch.collectors.engines import vllm_server as v\n"
                               "print(v.IMPORT_ROOT == pathlib.Path(cancelwatch.__file__).resolve().parents[1], "
                               "v.IMPORT_ROOT.name)", cwd=away)
    assert where.stdout.split() == ["True", "site-packages"], where.stdout + where.stderr[-2000:]
    for args, says in ((["--help"], "does a cancelled LLM request really leave the engine?"),
                       (["watch", "--help"], "--upstream"),
                       (["report", "latest", "--store", str(SAMPLE)], "neighbours ok")):
        res = run(str(cw), *args, cwd=away)
        assert res.returncode == 0 and says in res.stdout, (args, res.stdout[-2000:], res.stderr[-2000:])
    res = run(str(cw), "report", "latest", "--store", str(SAMPLE), "--html", str(tmp_path / "r.html"), cwd=away)
    assert res.returncode == 2 and "pip install 'cancelwatch[dashboard]'" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r.html").exists(), res.stderr
    res = run(str(cw), "notebook", "vram_plateau", "--html", str(tmp_path / "n.html"), cwd=away)
    assert res.returncode == 2 and "pip install 'cancelwatch[notebooks]'" in res.stderr, res.stderr
    # refused before anything is sent (port 9 answers nothing) or stored
    res = run(str(cw), "record", "--target", "grpc://127.0.0.1:9", "--scenario", "triton", "--store",
              str(tmp_path / "t.db"), cwd=away)
    assert res.returncode == 2 and "pip install 'cancelwatch[triton]'" in res.stderr, res.stdout + res.stderr
    assert not (tmp_path / "t.db").exists()

    got = run(str(py), "-m", "pip", "install", "-q", f"{wheel[0]}[dashboard]")
    assert got.returncode == 0, got.stderr[-3000:]
    page = run(str(py), "-c", "import cancelwatch.dashboard as dashboard, pathlib\n"
                              "from streamlit.testing.v1 import AppTest\n"
                              "at = AppTest.from_file(str(pathlib.Path(dashboard.__file__).with_name('app.py')), "
                              "default_timeout=240).run()\n"
                              "assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])\n"
                              "print([h.value for h in at.subheader])", cwd=away)
    assert page.returncode == 0 and "Timeline" in page.stdout, page.stdout[-2000:] + page.stderr[-3000:]
    print(f"\nbase install: {base_mb:.0f} MB; with [dashboard]: {size_mb(venv):.0f} MB")
