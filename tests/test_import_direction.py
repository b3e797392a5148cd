"""The import direction (docs/design.md, "Data flow"): the rooms under
flowpacer/ import downwards only. sources/, policy/ and kernel/ never import daemon/ or
surfaces/; daemon/ never imports surfaces/. The modules at the top (model.py, errors.py,
units.py, text.py) are shared by all. Every import is read from the source with ``ast``,
those inside functions included; imports by name at run time (``importlib``, the backend
registry's codec paths) are not seen."""
import ast
import os
from typing import Dict, FrozenSet, Iterator, Optional, Tuple

import flowpacer

PACKAGE = os.path.dirname(os.path.abspath(flowpacer.__file__))

# what each room may not import
FORBIDDEN = {
    "sources": {"daemon", "surfaces"},
    "policy": {"daemon", "surfaces"},
    "kernel": {"daemon", "surfaces"},
    "daemon": {"surfaces"},
}

# Known violations, each named and explained: importing module -> (what it may import of a
# room above it, why). Any other import upwards, from these modules too, fails.
EXCEPTIONS: Dict[str, Tuple[FrozenSet[str], str]] = {
    # app.py is the daemon's composition root: it makes the stages, the control and metrics
    # servers among them, and answers status and explain through the view. Wiring the servers
    # from a module above both rooms (e.g. flowpacer/main.py) moves most of app.py (its
    # status() assembly is already in surfaces/view.py's status_json; issue 25).
    "flowpacer.daemon.app": (frozenset({
        "flowpacer.surfaces", "flowpacer.surfaces.view", "flowpacer.surfaces.explain",
        "flowpacer.surfaces.control", "flowpacer.surfaces.metrics",
        "flowpacer.surfaces.webconfig"}),
        "the composition root wires the surfaces' servers; to move above daemon/ (issue 25)"),
}


def modules() -> Iterator[Tuple[str, str]]:
    """(dotted module name, path) of every module of the package."""
    root = os.path.dirname(PACKAGE)
    for d, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                yield ".".join(rel), path


def imported(name: str, path: str) -> Iterator[Tuple[str, int]]:
    """(absolute module name, line) of every import in the module ``name`` at ``path``; for
    ``from X import y`` X, and X.y when y is a module of the package."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.module, node.level)
            if base is None:
                continue
            yield base, node.lineno
            for a in node.names:
                if is_module(f"{base}.{a.name}"):
                    yield f"{base}.{a.name}", node.lineno


def _resolve(package: str, module: Optional[str], level: int) -> Optional[str]:
    if level == 0:
        return module
    parts = package.split(".")
    if level - 1 > len(parts):
        return None
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def is_module(module: str) -> bool:
    """Whether ``module`` is a module or package of flowpacer (a file or directory)."""
    parts = module.split(".")
    if parts[0] != "flowpacer":
        return False
    path = os.path.join(PACKAGE, *parts[1:])
    return os.path.isdir(path) or os.path.isfile(path + ".py")


def room(module: str) -> Optional[str]:
    """The room of a flowpacer module ("kernel" for flowpacer.kernel.backend.tc); None for the
    shared modules at the top and anything outside the package."""
    parts = module.split(".")
    if parts[0] != "flowpacer" or len(parts) < 2:
        return None
    return parts[1] if os.path.isdir(os.path.join(PACKAGE, parts[1])) else None


def violations():
    out = []
    for name, path in modules():
        mine = room(name)
        for target, line in imported(name, path):
            if room(target) in FORBIDDEN.get(mine, ()):
                out.append((name, target, line))
    return out


def _excepted(module: str, target: str) -> bool:
    return target in EXCEPTIONS.get(module, (frozenset(), ""))[0]


def test_the_rooms_import_downwards_only():
    bad = [f"{m}:{line} imports {t}" for m, t, line in violations() if not _excepted(m, t)]
    assert not bad, "\n".join(bad)


def test_every_exception_is_still_needed():
    """An exception whose import went is taken off the list (it would hide a new one)."""
    found = {(m, t) for m, t, _line in violations()}
    stale = [(m, t) for m, (allowed, _why) in EXCEPTIONS.items() for t in allowed
             if (m, t) not in found]
    assert not stale, stale


def test_the_checker_sees_each_kind_of_import(tmp_path):
    """Absolute, from-package, relative and function-level imports are all seen."""
    p = tmp_path / "m.py"
    p.write_text("import flowpacer.surfaces.metrics\n"
                 "from flowpacer import surfaces\n"
                 "from ...surfaces.view import build\n"
                 "def f():\n    from ..reconciler import Reconciler\n")
    got = {t for t, _ in imported("flowpacer.kernel.backend.m", str(p))}
    assert {"flowpacer.surfaces.metrics", "flowpacer.surfaces", "flowpacer.surfaces.view",
            "flowpacer.kernel.reconciler"} <= got
    p.write_text("from flowpacer.daemon import reconciler\n")
    assert [t for t, _ in imported("flowpacer.policy.m", str(p))] == [
        "flowpacer.daemon", "flowpacer.daemon.reconciler"]
    assert room("flowpacer.surfaces.view") == "surfaces" and room("flowpacer.model") is None
    assert room("flowpacer.kernel.backend.tc") == "kernel"
