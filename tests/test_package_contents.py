"""The installed package is the product (issue 25): the wheel built from this tree holds the
daemon's modules, grouped in their rooms, and the BPF programs it loads; not the testbed, the
demo, the traffic tools, the simulator or the module's source. (The .deb's list is checked the
same way in tests/test_deb.py.)"""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from harness import package

ROOT = Path(__file__).resolve().parents[1]


def test_problems_names_each_misplaced_file():
    good = ["flowpacer/__init__.py", "flowpacer/model.py", "flowpacer/sources/tracer.py",
            "flowpacer/sources/bpf/flowtrace.c", "flowpacer/policy/engine.py",
            "flowpacer/kernel/backend/tc.py", "flowpacer/daemon/app.py",
            "flowpacer/surfaces/cli.py"]
    assert package.problems(good) == []
    bad = package.problems(good + ["flowpacer/testbed.py", "flowpacer/tools/blaster.py",
                                   "flowpacer/kernel/kmod/sch_psp.c", "flowpacer/reconciler.py",
                                   "flowpacer/daemon/notes.txt"])
    assert len(bad) == 5, bad
    assert package.problems(["flowpacer/model.py"])[-1].startswith("rooms missing")


def test_wheel_holds_the_product_only(tmp_path):
    # the wheel's inputs only (pip builds a local tree in place: a copy keeps build/ and the
    # egg-info out of the checkout), without git: the Debian 13 root runs this with no git
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "flowpacer", src / "flowpacer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q", "-w", str(tmp_path / "out"),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = (tmp_path / "out").glob("flowpacer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flowpacer/daemon/app.py" in names and "flowpacer/sources/bpf/firstbyte.c" in names
    assert package.problems(names) == []
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"flowpacer"}, top
