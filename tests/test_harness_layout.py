"""One harness (issue 12): tests and benchmarks share ``harness/``; no test module imports another
test module, no benchmark imports a test, the harness imports neither; one Testbed class and
one daemon launcher in the tree."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path):
    """(line, imported module) of every import in a file; relative imports as '.name'."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or "")


def _py(*dirs):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def _bad(files, pred):
    return [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in files for line, mod in _imports(p)
            if pred(mod)]


def test_no_test_imports_a_test_module_or_bench():
    def bad(mod):
        last = mod.split(".")[-1]
        return mod.startswith(("tests.", "bench")) or (last.startswith("test_") and mod != "test_")
    assert not _bad(_py("tests"), bad)


def test_benchmarks_and_harness_do_not_import_tests():
    assert not _bad(_py("bench"), lambda m: m == "tests" or m.startswith("tests."))
    assert not _bad(_py("harness"), lambda m: m.split(".")[0] in ("tests", "bench"))


def test_benchmarks_and_harness_do_not_import_test_files_by_path():
    """Nor through sys.path: a bare import of a module that is a file under tests/ (the guest
    tests' directory is put on sys.path by their conftest) means a benchmark or the harness
    depends on the tests; such tools belong in harness/ (as harness/pacing.py, harness/psplib.py)."""
    test_stems = {p.stem for p in _py("tests")}
    assert "conftest" in test_stems and "kmsg" in test_stems, test_stems   # the check sees them
    bad = _bad(_py("bench", "harness"), lambda m: m.split(".")[0] in test_stems)
    assert not bad, bad


def test_one_testbed_class_and_one_daemon_launcher():
    """``Testbed`` is defined once; the launcher of ``flowpacer run`` in a testbed is
    ``harness.testbed.Daemon`` (the daemon itself is ``flowpacer.daemon.app.Daemon``)."""
    testbeds, launchers = [], []
    for p in _py("flowpacer", "harness", "tests", "bench"):
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Testbed":
                testbeds.append(str(p.relative_to(ROOT)))
            if isinstance(node, ast.ClassDef) and node.name in ("Daemon", "Run", "BenchDaemon"):
                launchers.append(str(p.relative_to(ROOT)))
    assert testbeds == ["harness/testbed.py"], testbeds
    assert sorted(launchers) == ["flowpacer/daemon/app.py", "harness/testbed.py"], launchers
