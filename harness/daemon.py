"""The daemon runner: ``flowpacer run`` in a testbed's server namespace, for tests and benchmarks.

    d = Daemon(tb, tmp_path, RULES, "--rescan", "0.2").start()     # waits until it answers
    d.flows(); d.status(); d.call({"cmd": "reload"})
    assert d.stop() == 0                                           # SIGTERM, its exit status

The rules text may name the server interface ``IFACE`` and the backend ``BACKEND`` (replaced by
``tb.server_if`` and ``backend``). With ``rules=None`` an existing ``WORKDIR/rules.yaml`` is used
as it is (a restart after a crash). The daemon's stderr goes to ``WORKDIR/daemon.log``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from flowpacer.control import call
from flowpacer.errors import FlowpacerError
from flowpacer.testbed import PY, wait_for

# The three-rule file most daemon tests use: two inbound rules of the server fp-test-srv on
# ports 9101 (10 Mbit/s) and 9102 (100 Mbit/s), one outbound rule of the client fp-test-cli.
RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: slow
        match: {process: fp-test-srv, direction: inbound, local_port: 9101}
        rate: 10mbit
      - name: fast
        match: {process: fp-test-srv, direction: inbound, local_port: 9102}
        rate: 100mbit
      - name: out
        match: {process: fp-test-cli, direction: outbound, remote_port: 9201}
        rate: 20mbit
"""

FLOWPACER = (PY, "-m", "flowpacer.cli")


class DaemonExited(AssertionError):
    """The daemon exited while it was expected to run; the message ends with its log."""


class Daemon:
    """One ``flowpacer run`` process in ``tb``'s server namespace.

    ``extra`` are more ``run`` options; ``verbose`` adds ``-v``; ``command`` replaces
    ``python -m flowpacer.cli`` (an installed ``bin/flowpacer``, a sandbox wrapper);
    ``log_mode="a"`` appends to the log (a restart in the same work directory).
    """

    def __init__(self, tb, workdir=None, rules: Optional[str] = None, *extra: str,
                 backend: str = "htb", verbose: bool = True, command: Sequence[str] = FLOWPACER,
                 log_mode: str = "w", env: Optional[dict] = None, rules_mode: int = 0o644):
        self.tb = tb
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="fp-d-"))
        self.rules = self.workdir / "rules.yaml"
        if rules is not None:
            self.rules.write_text(textwrap.dedent(rules).replace("IFACE", tb.server_if)
                                  .replace("BACKEND", backend))
            self.rules.chmod(rules_mode)
        self.sock = str(self.workdir / "control.sock")
        self.log = self.workdir / "daemon.log"
        self.extra: List[str] = list(extra)
        self.verbose = verbose
        self.command = list(command)
        self.log_mode = log_mode
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.t_start: Optional[float] = None
        self._logf = None

    # ------------------------------------------------------------------ lifecycle
    def argv(self) -> List[str]:
        return [*self.command, "run", "--rules", str(self.rules), "--socket", self.sock,
                *(["-v"] if self.verbose else []), *self.extra]

    def start(self, wait: bool = True, timeout: float = 90) -> "Daemon":
        self._logf = open(self.log, self.log_mode)
        self.t_start = time.monotonic()
        kw = {"env": self.env} if self.env is not None else {}
        self.proc = self.tb.popen(self.tb.server_ns, self.argv(), stderr=self._logf, **kw)
        if wait:
            self.wait_ready(timeout)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DaemonExited(f"the daemon exited {self.proc.returncode}:\n{self.log_text()[-3000:]}")

    def ready(self):
        """The ping answer, or None while the control socket does not answer yet."""
        self._check_alive()
        try:
            return call(self.sock, {"cmd": "ping"}, timeout=2)
        except FlowpacerError:
            return None

    def wait_ready(self, timeout: float = 90):
        return wait_for(self.ready, timeout, 0.05, "the daemon to answer on its control socket")

    def stop(self, timeout: float = 60) -> Optional[int]:
        """SIGTERM and wait; the exit status (None if it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        if self._logf is not None:
            self._logf.close()
        return self.proc.returncode

    def kill(self, timeout: float = 10) -> None:
        """SIGKILL (no clean-up by the daemon) and reap."""
        os.kill(self.pid(), signal.SIGKILL)
        self.proc.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def __enter__(self) -> "Daemon":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ asking
    def call(self, req: dict, timeout: float = 30) -> dict:
        return call(self.sock, req, timeout=timeout)

    def status(self, timeout: float = 30) -> dict:
        return self.call({"cmd": "status"}, timeout=timeout)

    def try_status(self, timeout: float = 30) -> Optional[dict]:
        """The status, or None when the control socket does not answer."""
        try:
            return self.status(timeout=timeout)
        except FlowpacerError:
            return None

    def flows(self) -> list:
        return self.status()["flows"]

    def status_cli(self) -> dict:
        """``flowpacer status --json`` (the command line, as a user would run it)."""
        r = self.tb.run(self.tb.server_ns, [*FLOWPACER, "status", "--json", "--socket", self.sock],
                        timeout=60)
        return json.loads(r.stdout)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ the process
    def pid(self) -> int:
        """The daemon's own pid (``ip netns exec`` execs it, so normally the Popen's)."""
        try:
            with open(f"/proc/{self.proc.pid}/cmdline", "rb") as f:
                if b"run\0--rules\0" + str(self.rules).encode() in f.read():
                    return self.proc.pid
        except OSError:
            pass
        out = subprocess.run(["pgrep", "-f", f"run --rules {self.rules}"], capture_output=True,
                             text=True).stdout.split()
        if not out:
            raise DaemonExited(f"no daemon process of {self.rules}:\n{self.log_text()[-3000:]}")
        return int(out[0])

    def rss_fds(self) -> tuple:
        """(resident bytes, open fds) of the daemon process."""
        pid = self.pid()
        rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))

    def memory(self) -> dict:
        """{"rss_bytes", "peak_rss_bytes"} of the daemon process."""
        out = {}
        with open(f"/proc/{self.pid()}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
        return {"rss_bytes": out.get("VmRSS", 0), "peak_rss_bytes": out.get("VmHWM", 0)}

    def cpu_s(self) -> float:
        """User + system CPU seconds the daemon used so far."""
        with open(f"/proc/{self.pid()}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def healthy(status: dict) -> List[str]:
    """What is wrong with a status answer's stage report ([] when every stage runs).

    The status answer carries ``stages`` and ``healthy`` since the daemon's stages are
    supervised (issue 12); a stage turned off by an option is "disabled", which is fine; a
    missing key is reported as a problem too."""
    bad = []
    if "stages" not in status or "healthy" not in status:
        return ["the status answer has no 'stages'/'healthy' keys"]
    for st in status["stages"]:
        if st.get("state") not in ("running", "disabled"):
            bad.append(f"stage {st.get('name')} is {st.get('state')} (failures "
                       f"{st.get('failures')}, last error {st.get('last_error')!r})")
    if not status["healthy"] and not bad:
        bad.append("status says healthy=false")
    return bad


def tracebacks(log_text: str) -> Iterable[str]:
    """The tracebacks in a daemon log, each with the lines around it."""
    lines = log_text.splitlines()
    for i, ln in enumerate(lines):
        if "Traceback" in ln:
            yield "\n".join(lines[max(0, i - 2):i + 25])
