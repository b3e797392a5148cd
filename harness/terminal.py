"""A private tmux server for tests of full-screen commands (``flowpacer top``, ``edit``)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from harness.testbed import PY, wait_for

ROOT = str(Path(__file__).resolve().parents[1])


class Tmux:
    """A private tmux server (its own socket under tmp_path), killed on exit.

    The command runs under a small wrapper that writes its exit status to a file: tmux 3.3a
    sometimes marks a pane dead without ever filling in #{pane_dead_status}."""

    WRAP = "import subprocess, sys; rc = subprocess.call(sys.argv[2:]); open(sys.argv[1], 'w').write(str(rc))"

    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.sock = str(tmp_path / "tmux.sock")
        self.conf = tmp_path / "tmux.conf"
        self.conf.write_text("set -g remain-on-exit on\nset -g status off\n")
        self.runs = 0
        self.status_file = None

    def __call__(self, *args, check=True):
        return subprocess.run(["tmux", "-S", self.sock, "-f", str(self.conf), *args],
                              capture_output=True, text=True, timeout=10, check=check)

    def start(self, argv, env=(), x=160, y=40):
        self.runs += 1
        self.status_file = self.dir / f"tmux-exit-{self.runs}"
        envargs = [a for k, v in env for a in ("-e", f"{k}={v}")]
        # several arguments: tmux execs them directly, no shell in between
        self("new-session", "-d", "-s", "t", "-x", str(x), "-y", str(y), "-c", ROOT,
             *envargs, PY, "-c", self.WRAP, str(self.status_file), *argv)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t").stdout

    def dead(self):
        """None while the command runs, else its exit status."""
        try:
            return int(self.status_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def wait_screen(self, pred, timeout, what):
        last = []

        def cond():
            last[:] = [self.screen()]
            return last[0] if pred(last[0]) else None
        try:
            return wait_for(cond, timeout, 0.1, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}; the pane shows:\n{last[0] if last else ''}") from None

    def wait_exit(self, timeout=10) -> int:
        try:
            wait_for(lambda: self.dead() is not None, timeout, 0.05, "the command to exit")
        except TimeoutError as e:
            raise AssertionError(f"{e}; the pane shows:\n{self.screen()}") from None
        return self.dead()

    def kill(self, timeout=10) -> None:
        """Kill the server and wait until it no longer answers on its socket: kill-server
        returns before the server has gone, and a session started on the socket meanwhile
        fails ("server exited unexpectedly", rc 1: make check under load, 29 Nov)."""
        self("kill-server", check=False)

        def gone():
            r = self("has-session", check=False)
            return r.returncode != 0 and ("no server running" in r.stderr
                                          or "error connecting" in r.stderr)
        wait_for(gone, timeout, 0.02, "the tmux server gone")

    def close(self):
        self("kill-server", check=False)
