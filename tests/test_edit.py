"""`flowpacer rules edit`: a scripted editor (EDITOR = a small Python script with arguments)
drives the real command; with a real daemon in a testbed the reload is checked through
`flowpacer status --json`; and once through tmux with vi and the "(e)dit again" prompt."""
import json
import os
import re
import shlex
import stat
import subprocess
import textwrap

import pytest

from flowpacer.surfaces.edit import EditError, editor_argv
from harness.testbed import PY, client_argv, server_argv, wait_for

from harness.daemon import RULES, Daemon

EDITOR = r'''
import os, sys, time
mode, path = sys.argv[1], sys.argv[-1]
text = open(path).read()
real = os.environ.get("FP_REAL", "")
if mode == "fail":
    sys.exit(3)
if mode == "same":
    sys.exit(0)
if mode == "bad":
    text = text.replace("rate: 10mbit", "rate: 10parsecs").replace("rate: 100mbit", "rate: -5mbit")
elif mode == "rate":
    text = text.replace("rate: 10mbit", "rate: 30mbit")
elif mode == "fast":
    text = text.replace("rate: 100mbit", "rate: 200mbit")
elif mode == "hold":          # say we started, wait to be released (bounded), then edit
    open(os.environ["FP_MARK"], "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.environ["FP_RELEASE"]):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.02)
    text = text.replace("rate: 10mbit", "rate: 11mbit")
elif mode == "clobber":       # someone else writes the real file meanwhile
    with open(real, "a") as f:
        f.write("# changed by someone else\n")
    text = text.replace("rate: 10mbit", "rate: 12mbit")
elif mode == "delete":
    os.unlink(real)
    text = text.replace("rate: 10mbit", "rate: 13mbit")
elif mode == "unreadable":    # the file's name now leads to something that cannot be read
    os.unlink(real)
    os.mkdir(real)
    text = text.replace("rate: 10mbit", "rate: 14mbit")
else:
    sys.exit(f"unknown mode {mode}")
with open(path, "w") as f:
    f.write(text)
'''

PLAIN_RULES = textwrap.dedent("""\
    interface: eth0
    backend: htb
    link_rate: 1gbit
    rules:
      - name: slow
        match: {process: fp-test-srv, direction: inbound, local_port: 9101}
        rate: 10mbit
      - name: fast
        match: {process: fp-test-srv, local_port: 9102}
        rate: 100mbit
""")


@pytest.fixture
def editor(tmp_path):
    script = tmp_path / "fake editor.py"          # a space: $EDITOR is split like a shell would
    script.write_text(EDITOR)
    return lambda mode: f"{shlex.quote(PY)} {shlex.quote(str(script))} {mode}"


def run_edit(tmp_path, editor_cmd, *args, env=None, timeout=60):
    e = dict(os.environ, EDITOR=editor_cmd, TMPDIR=str(tmp_path))
    e.pop("VISUAL", None)
    e.update(env or {})
    return subprocess.run([PY, "-m", "flowpacer", "rules", "edit", *args], env=e,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def no_traceback(r):
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


def leftovers(d):
    """Files in d other than the ones the test expects to exist."""
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def rules_file(tmp_path):
    d = tmp_path / "etc"
    d.mkdir()
    f = d / "rules.yaml"
    f.write_text(PLAIN_RULES)
    return f


def nosock(tmp_path):
    return ["--socket", str(tmp_path / "none.sock")]


# ------------------------------------------------------------------ with a real daemon

def test_edit_reloads_the_running_daemon(testbed, tmp_path, editor):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES).start()
    try:
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 30))
        f0 = wait_for(d.settled_flows, 10, 0.05, "the shaped flow, its claim handled")[0]
        assert f0["rate_bit"] == 10_000_000
        os.chown(d.rules, 0, 4322)          # the daemon wants root-owned rules
        os.chmod(d.rules, 0o640)
        before = d.rules.read_text()
        reloads = d.status()["counters"]["reloads_ok"]

        # nothing changed: said so, no reload
        r = no_traceback(run_edit(tmp_path, editor("same"), "--socket", d.sock))
        assert r.returncode == 0 and "no changes" in r.stdout
        assert d.status()["counters"]["reloads_ok"] == reloads

        # invalid, no terminal: every problem as REAL-FILE:LINE:COL, discarded, exit 2
        r = no_traceback(run_edit(tmp_path, editor("bad"), "--socket", d.sock))
        assert r.returncode == 2
        errs = [l for l in r.stderr.splitlines() if l.startswith(f"{d.rules}:")]
        assert len(errs) == 2 and all(re.match(rf"{re.escape(str(d.rules))}:\d+:\d+: rule '\w+': rate", l)
                                      for l in errs), r.stderr
        assert "not a terminal" in r.stderr and "discarded" in r.stderr
        assert d.rules.read_text() == before and not (tmp_path / "rules.yaml.bak").exists()

        # the editor fails: discarded, exit 1, said so
        r = no_traceback(run_edit(tmp_path, editor("fail"), "--socket", d.sock))
        assert r.returncode == 1 and "exited with status 3" in r.stderr and "discarded" in r.stderr
        assert d.rules.read_text() == before
        assert d.status()["counters"]["reloads_ok"] == reloads

        # the real edit: FILE comes from the daemon; saved, reloaded, and it says what happened
        r = no_traceback(run_edit(tmp_path, editor("rate"), "--socket", d.sock))
        assert r.returncode == 0, r.stderr
        assert f"{d.rules} saved (previous version in {d.rules}.bak)" in r.stdout
        assert "daemon reloaded: rules changed, 1 flows re-rated, 0 added, 0 removed" in r.stdout
        st = json.loads(subprocess.run([PY, "-m", "flowpacer", "status", "--json", "--socket",
                                        d.sock], capture_output=True, text=True, timeout=30,
                                       check=True).stdout)
        f1 = [f for f in st["flows"] if f["remote"] == f0["remote"]][0]
        assert f1["rate_bit"] == 30_000_000 and f1["classid"] == f0["classid"]
        assert st["counters"]["reloads_ok"] == reloads + 1
        assert "rate: 30mbit" in d.rules.read_text()
        bak = tmp_path / "rules.yaml.bak"
        assert bak.read_text() == before
        for p in (d.rules, bak):                      # owner and mode kept, on both
            s = p.stat()
            assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (0, 4322, 0o640), p
        # no temporary files left, neither next to the file nor in TMPDIR
        assert not [n for n in leftovers(tmp_path) if n.startswith((".rules", "flowpacer-edit"))]
    finally:
        assert d.stop() == 0


# ------------------------------------------------------------------ without a daemon

def test_no_daemon_saves_and_says_not_reloaded(tmp_path, rules_file, editor):
    os.chmod(rules_file, 0o600)
    r = no_traceback(run_edit(tmp_path, editor("rate"), str(rules_file), *nosock(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "rate: 30mbit" in rules_file.read_text()
    assert "saved" in r.stdout and "daemon was not reloaded" in r.stdout and "no daemon answers" in r.stdout
    assert stat.S_IMODE(rules_file.stat().st_mode) == 0o600
    assert (rules_file.parent / "rules.yaml.bak").read_text() == PLAIN_RULES
    assert leftovers(rules_file.parent) == ["rules.yaml", "rules.yaml.bak", "rules.yaml.lock"]
    # again: the .bak is now the previous version, not the first one
    r = no_traceback(run_edit(tmp_path, editor("fast"), str(rules_file), *nosock(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "rate: 200mbit" in rules_file.read_text()
    assert (rules_file.parent / "rules.yaml.bak").read_text() == PLAIN_RULES.replace("10mbit", "30mbit")


def test_concurrent_edit_is_refused_with_the_holders_pid(tmp_path, rules_file, editor):
    mark, release = tmp_path / "started", tmp_path / "release"
    env = dict(os.environ, EDITOR=editor("hold"), TMPDIR=str(tmp_path), FP_MARK=str(mark),
               FP_RELEASE=str(release))
    first = subprocess.Popen([PY, "-m", "flowpacer", "rules", "edit", str(rules_file),
                              *nosock(tmp_path)], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: mark.exists() or first.poll() is not None, 20, 0.02, "the first editor")
        assert first.poll() is None, first.communicate()
        # through a symlink too: the lock belongs to the real file
        link = tmp_path / "link.yaml"
        link.symlink_to(rules_file)
        for name in (rules_file, link):
            r = no_traceback(run_edit(tmp_path, editor("rate"), str(name), *nosock(tmp_path)))
            assert r.returncode == 1
            assert f"{name} is being edited by pid {first.pid}" in r.stderr, r.stderr
        assert rules_file.read_text() == PLAIN_RULES          # the second editor never ran
        release.touch()
        out, err = first.communicate(timeout=30)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)
    assert "rate: 11mbit" in rules_file.read_text()
    # once the first is done, the next edit goes through
    r = no_traceback(run_edit(tmp_path, editor("same"), str(rules_file), *nosock(tmp_path)))
    assert r.returncode == 0 and "no changes" in r.stdout


def _kept_copy(stderr):
    m = re.search(r"your version is kept in (\S+)$", stderr.strip())
    assert m, stderr
    return m.group(1)


def test_file_changed_underneath_is_not_replaced_and_the_edit_is_kept(tmp_path, rules_file, editor):
    r = no_traceback(run_edit(tmp_path, editor("clobber"), str(rules_file), *nosock(tmp_path),
                              env={"FP_REAL": str(rules_file)}))
    assert r.returncode == 1
    assert "was changed by someone else while you edited it: not replaced" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    kept = _kept_copy(r.stderr)
    assert open(kept).read() == PLAIN_RULES.replace("10mbit", "12mbit")      # the user's edit
    assert rules_file.read_text() == PLAIN_RULES + "# changed by someone else\n"   # the other's
    assert not (rules_file.parent / "rules.yaml.bak").exists()


@pytest.mark.parametrize("mode,msg", [("delete", "was deleted while you edited it"),
                                      ("unreadable", "cannot be read any more (Is a directory)")])
def test_file_gone_during_the_edit_is_one_line_and_the_edit_is_kept(tmp_path, rules_file, editor,
                                                                      mode, msg):
    r = no_traceback(run_edit(tmp_path, editor(mode), str(rules_file), *nosock(tmp_path),
                              env={"FP_REAL": str(rules_file)}))
    assert r.returncode == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    kept = _kept_copy(r.stderr)
    assert "rate: 1" in open(kept).read() and open(kept).read() != PLAIN_RULES


def test_edit_through_a_symlink_replaces_the_target(tmp_path, rules_file, editor):
    link = tmp_path / "link.yaml"
    link.symlink_to(rules_file)
    r = no_traceback(run_edit(tmp_path, editor("rate"), str(link), *nosock(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and "rate: 30mbit" in rules_file.read_text()
    assert f"{link} saved (previous version in {rules_file}.bak)" in r.stdout
    assert (rules_file.parent / "rules.yaml.bak").read_text() == PLAIN_RULES


@pytest.mark.parametrize("setup,msg", [
    ("missing", "cannot read {f}: No such file or directory"),
    ("noeditor", "cannot run the editor /nonexistent/editor"),
    ("badquote", "$EDITOR cannot be split into a command"),
    ("nodir", "cannot read {f}: No such file or directory"),
    ("lockdir", "cannot create the lock file"),
])
def test_failures_before_editing_are_one_line(tmp_path, rules_file, editor, setup, msg):
    f, ed = rules_file, editor("rate")
    if setup == "missing":
        f = rules_file.parent / "absent.yaml"
    elif setup == "noeditor":
        ed = "/nonexistent/editor --flag"
    elif setup == "badquote":
        ed = "vi 'unclosed"
    elif setup == "nodir":
        f = tmp_path / "no-such-dir" / "rules.yaml"
    elif setup == "lockdir":
        (rules_file.parent / "rules.yaml.lock").mkdir()
    r = no_traceback(run_edit(tmp_path, ed, str(f), *nosock(tmp_path)))
    assert r.returncode == 1 and msg.format(f=f) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert rules_file.read_text() == PLAIN_RULES


def test_editor_choice():
    assert editor_argv({"VISUAL": "code --wait", "EDITOR": "nano"}) == ["code", "--wait"]
    assert editor_argv({"VISUAL": " ", "EDITOR": "vim -u 'my rc'"}) == ["vim", "-u", "my rc"]
    assert editor_argv({"PATH": os.environ["PATH"]}) in (["editor"], ["vi"])
    with pytest.raises(EditError):
        editor_argv({"EDITOR": "a 'b"})


# ------------------------------------------------------------------ vi in tmux

def test_vi_in_tmux_edit_again_then_discard(tmp_path, rules_file, tmux):
    argv = [PY, "-m", "flowpacer", "rules", "edit", str(rules_file), *nosock(tmp_path)]
    env = [("EDITOR", "vi -u NONE -i NONE -n"), ("TMPDIR", str(tmp_path))]
    # the file shown in vi (and not the previous prompt still on the screen: under load the
    # prompt's own text can hold the edit and a "~" before vi has redrawn the pane)
    vi_ready = lambda text: lambda s: (text in s and "~" in s       # noqa: E731
                                       and "(e)dit again" not in s)

    def keys(*ks):
        tmux("send-keys", "-t", "t", *ks)

    def typed(text):
        tmux("send-keys", "-t", "t", "-l", text)
        keys("Enter")

    tmux.start(argv, env=env, x=120, y=40)
    tmux.wait_screen(vi_ready("rate: 10mbit"), 15, "vi showing the rules")
    typed(":%s/rate: 10mbit/rate: 10parsecs/")
    typed(":wq")
    screen = tmux.wait_screen(lambda s: "(e)dit again, (d)iscard?" in s, 15, "the prompt")
    assert re.search(rf"^{re.escape(str(rules_file))}:7:11: rule 'slow': rate: unknown rate unit",
                     screen, re.M), screen
    keys("e", "Enter")
    tmux.wait_screen(vi_ready("rate: 10parsecs"), 15, "vi again, with the edit")
    typed(":%s/10parsecs/20mbit/")
    typed(":wq")
    screen = tmux.wait_screen(lambda s: "saved" in s, 15, "saved")
    assert tmux.wait_exit() == 0, screen
    assert "rate: 20mbit" in rules_file.read_text()
    assert (rules_file.parent / "rules.yaml.bak").read_text() == PLAIN_RULES
    tmux.kill()

    # and (d)iscard: exit 2, the file as it was
    saved = rules_file.read_text()
    tmux.start(argv, env=env, x=120, y=40)
    tmux.wait_screen(vi_ready("rate: 20mbit"), 15, "vi showing the rules")
    typed(":%s/rate: 20mbit/rate: lots/")
    typed(":wq")
    tmux.wait_screen(lambda s: "(e)dit again, (d)iscard?" in s, 15, "the prompt")
    keys("d", "Enter")
    assert tmux.wait_exit() == 2
    assert "changes discarded" in tmux.screen()
    assert rules_file.read_text() == saved
