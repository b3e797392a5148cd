"""What the installed package may hold: the product, grouped by where each module stands in
the flow, and nothing of the test kit (issue 25). ``problems(paths)`` reads the paths of a
wheel's or a ``.deb``'s ``flowpacer/`` files; tests/test_package_contents.py and
tests/test_deb.py both ask it."""
from __future__ import annotations

from pathlib import PurePosixPath
from typing import Iterable, List

# sources -> flow table/engine (policy) -> backend (kernel) -> ..., wired by the daemon and read
# by the surfaces; model, errors and units are the shared vocabulary of every room
ROOMS = ("sources", "policy", "kernel", "daemon", "surfaces")
SHARED = ("__init__.py", "__main__.py", "model.py", "errors.py", "units.py", "text.py")
# what belongs to the test kit (harness/) or to the sch-psp-dkms package, never to flowpacer
TEST_KIT = ("testbed", "demo", "blaster", "pspsim", "sim", "kmod", "harness", "tests", "fakes")


def problems(paths: Iterable[str]) -> List[str]:
    """One line per file that does not belong in the installed ``flowpacer`` package; paths are
    relative to the directory holding ``flowpacer/`` (``flowpacer/daemon/app.py``)."""
    out, rooms = [], set()
    for raw in paths:
        p = PurePosixPath(raw)
        if not p.parts or p.parts[0] != "flowpacer" or raw.endswith("/"):
            continue
        rel = p.parts[1:]
        if not rel or "__pycache__" in rel:
            continue
        stems = {PurePosixPath(part).stem for part in rel}
        if stems & set(TEST_KIT):
            out.append(f"{raw}: part of the test kit or of sch-psp-dkms")
            continue
        if len(rel) == 1:
            if rel[0] not in SHARED:
                out.append(f"{raw}: a module outside the rooms {', '.join(ROOMS)}")
            continue
        if rel[0] not in ROOMS:
            out.append(f"{raw}: {rel[0]}/ is not one of the rooms {', '.join(ROOMS)}")
            continue
        rooms.add(rel[0])
        if p.suffix != ".py" and not (rel[:2] == ("sources", "bpf") and p.suffix in (".c", ".h")):
            out.append(f"{raw}: not Python (only the sources' BPF programs are shipped as C)")
    missing = [r for r in ROOMS if r not in rooms]
    if missing:
        out.append(f"rooms missing: {', '.join(missing)}")
    return out
