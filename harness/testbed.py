"""A two-host network-namespace testbed (used by ``make demo``, the tests and the benchmarks,
which reach it through the ``harness`` package; this is the project's one Testbed class).

    namespace SERVER  [ifname 10.77.x.1/24 fd77:x::1/64] ==veth== [peer 10.77.x.2 fd77:x::2]  namespace CLIENT

The pacing tools of the test VM see the same two namespaces as a sender (the server's side,
whose veth gets the qdisc under test) and a receiver: ``sender_ns``, ``sender_dev``,
``sender_addr``, ``receiver_*``, ``s(...)``/``r(...)`` to run a command on either side.

Only these addresses are used, every process started here is bounded in time, and everything
is deleted on exit (also on an exception or Ctrl-C).
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from flowpacer.surfaces.control import call
from flowpacer.errors import FlowpacerError


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def wait_for(cond: Callable[[], object], timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``cond`` until it returns a truthy value; raise TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def stop_process_groups(procs: List[subprocess.Popen], grace_s: float = 5) -> None:
    """SIGTERM every process group started (start_new_session) and still running, SIGKILL
    those still there after grace_s; the list is emptied."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(timeout=grace_s)
    procs.clear()


# In virtual time a wait for the host (a file read over 9p) runs the guest's clock on, tick by
# tick, far faster than the host's (vm/run.py): the guest's own time limits are widened by this
# factor there (the host's limit on the whole VM run still bounds a real hang). A command's
# limit too: a `tc qdisc replace ... fq` had "no answer in 30 s" of guest time while the host
# was loaded (rehearsal ci28, virtual lane).
VIRTUAL_TIMEOUT_SCALE = 10


def virtual_time() -> bool:
    """True in the test VM's virtual-time mode (``vm/run.py --clock virtual``): guest time is
    counted in instructions, so timers fire on time whatever the host's load."""
    return os.environ.get("FLOWPACER_VM_CLOCK") == "virtual"


def guest_timeout(seconds: float) -> float:
    """A time limit in guest seconds: ``seconds``, widened in virtual time."""
    return seconds * (VIRTUAL_TIMEOUT_SCALE if virtual_time() else 1)


class TestbedError(Exception):
    """A testbed command failed; one line with the command and its stderr."""
    __test__ = False


def modprobe(*names: str) -> None:
    """Load modules. Where the kernel has no modules directory (a host kernel with everything
    built in) a failure is left to the command that needs the feature."""
    strict = os.path.exists(f"/lib/modules/{os.uname().release}/modules.dep")
    for n in names:
        p = subprocess.run(["modprobe", n], capture_output=True, text=True,
                           timeout=guest_timeout(30))
        if strict and p.returncode != 0:
            raise TestbedError(f"modprobe {n}: exit {p.returncode}: {p.stderr.strip()}")


class Testbed:
    __test__ = False  # not a pytest test class

    def __init__(self, server_if: Optional[str] = None, tag: Optional[str] = None,
                 subnet: Optional[int] = None, gso: bool = True):
        tag = tag or secrets.token_hex(3)
        self.tag = tag
        self.server_ns = f"fp-{tag}-s"
        self.client_ns = f"fp-{tag}-c"
        self.server_if = server_if or f"fp{tag}s"[:15]
        self.client_if = f"fp{tag}c"[:15]
        n = subnet if subnet is not None else (int(tag, 16) % 200 + 20 if all(c in "0123456789abcdef" for c in tag) else 77)
        self.server_v4 = ipaddress.IPv4Address(f"10.77.{n}.1")
        self.client_v4 = ipaddress.IPv4Address(f"10.77.{n}.2")
        self.server_v6 = ipaddress.IPv6Address(f"fd77:{n:x}::1")
        self.client_v6 = ipaddress.IPv6Address(f"fd77:{n:x}::2")
        self.gso = gso
        self._procs: List[subprocess.Popen] = []
        self._n = n
        self.clients: List["ClientLink"] = []      # add_client's further client namespaces

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Testbed":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        modprobe("veth")
        for ns in (self.server_ns, self.client_ns):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        self._veth((self.server_ns, self.server_if, self.server_v4, self.server_v6),
                   (self.client_ns, self.client_if, self.client_v4, self.client_v6), self.gso)

    def _veth(self, server, client, gso: bool = True) -> None:
        """A veth pair between two namespaces, each end (ns, ifname, v4, v6) addressed (/24,
        /64) and up; ``gso`` False: one segment per packet. Returns once the carrier is up."""
        sh("ip", "-n", server[0], "link", "add", server[1], "type", "veth",
           "peer", "name", client[1], "netns", client[0])
        for ns, ifn, v4, v6 in (server, client):
            sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", ifn)
            sh("ip", "-n", ns, "addr", "add", f"{v6}/64", "dev", ifn, "nodad")
            sh("ip", "-n", ns, "link", "set", ifn, "up")
            if not gso:
                sh("ip", "-n", ns, "link", "set", ifn, "gso_max_segs", "1", check=False)
        # the kernel only passes traffic once both ends are up: wait for the carrier
        wait_for(lambda: "LOWER_UP" in sh("ip", "-n", server[0], "-o", "link", "show",
                                          server[1]).stdout, 10, 0.02, "veth carrier")

    def destroy(self) -> None:
        stop_process_groups(self._procs)
        for ns in (self.server_ns, self.client_ns, *(c.ns for c in self.clients)):
            sh("ip", "netns", "del", ns, check=False)

    close = destroy

    def add_client(self, i: int = 2) -> "ClientLink":
        """A further client namespace ``fp-TAG-cI`` on a veth pair of its own: the server's
        ``fpTAGsI`` with 10.(76+I).x.1/24 and fd(76+I):x::1/64, the client's ``fpTAGcI`` with
        .2 and ::2, each family routed by its connected subnet (issue 29: several
        interfaces). Deleted with the testbed."""
        c = ClientLink(f"fp-{self.tag}-c{i}", f"fp{self.tag}s{i}"[:15], f"fp{self.tag}c{i}"[:15],
                       ipaddress.IPv4Address(f"10.{76 + i}.{self._n}.1"),
                       ipaddress.IPv4Address(f"10.{76 + i}.{self._n}.2"),
                       ipaddress.IPv6Address(f"fd{76 + i}:{self._n:x}::1"),
                       ipaddress.IPv6Address(f"fd{76 + i}:{self._n:x}::2"))
        self.clients.append(c)
        sh("ip", "netns", "del", c.ns, check=False)
        sh("ip", "netns", "add", c.ns)
        sh("ip", "-n", c.ns, "link", "set", "lo", "up")
        self._veth((self.server_ns, c.server_if, c.server_v4, c.server_v6),
                   (c.ns, c.client_if, c.client_v4, c.client_v6))
        return c

    # ------------------------------------------- the pacing tools' names: sender = server
    @property
    def suffix(self) -> str:
        return self.tag

    @property
    def sender_ns(self) -> str:
        return self.server_ns

    @property
    def receiver_ns(self) -> str:
        return self.client_ns

    @property
    def sender_dev(self) -> str:
        return self.server_if

    @property
    def receiver_dev(self) -> str:
        return self.client_if

    @property
    def sender_addr(self) -> str:
        return str(self.server_v4)

    @property
    def receiver_addr(self) -> str:
        return str(self.client_v4)

    def _ns_cmd(self, ns: str, args: Sequence, timeout: float = 30,
                check: bool = True) -> subprocess.CompletedProcess:
        argv = ["ip", "netns", "exec", ns] + [str(a) for a in args]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=guest_timeout(timeout))
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{' '.join(argv)}: no answer in {guest_timeout(timeout):.0f} s"
                               ) from None
        if check and proc.returncode != 0:
            raise TestbedError(f"{' '.join(argv)}: exit {proc.returncode}: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def s(self, *args, **kw) -> subprocess.CompletedProcess:
        """Run a command in the sender's (server's) namespace; TestbedError when it fails."""
        return self._ns_cmd(self.server_ns, args, **kw)

    def r(self, *args, **kw) -> subprocess.CompletedProcess:
        """Run a command in the receiver's (client's) namespace; TestbedError when it fails."""
        return self._ns_cmd(self.client_ns, args, **kw)

    def set_gso(self, on: bool) -> None:
        """GSO/TSO on the sender's veth on (the default) or off. Off also sets gso_max_segs 1:
        ethtool alone still lets TCP hand the qdisc ~64 KB skbs."""
        state = "on" if on else "off"
        self.s("ethtool", "-K", self.sender_dev, "tso", state, "gso", state)
        self.s("ip", "link", "set", self.sender_dev, "gso_max_segs", "65535" if on else "1")

    def clear_qdisc(self) -> None:
        self.s("tc", "qdisc", "del", "dev", self.sender_dev, "root", check=False)

    def qdisc_show(self) -> str:
        return self.s("tc", "-s", "qdisc", "show", "dev", self.sender_dev).stdout

    # --------------------------------------------------------------- running
    def popen(self, ns: str, argv: Sequence, **kw) -> subprocess.Popen:
        """Start a process inside a namespace, in its own process group (killed on destroy)."""
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *[str(a) for a in argv]],
                             start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, ns: str, argv: Sequence[str], timeout: float = 60, check: bool = True):
        return sh("ip", "netns", "exec", ns, *argv, timeout=guest_timeout(timeout), check=check)

    def fetch(self, port: int, seconds: float, v6: bool = False, local_port: int = 0,
              warmup: float = 1.0, name: str = "fp-client") -> dict:
        """Download from the server for ``seconds``; the client's JSON result."""
        host = str(self.server_v6 if v6 else self.server_v4)
        r = self.run(self.client_ns, client_argv(host, port, seconds, warmup, name, local_port),
                     timeout=seconds + 30)
        return json.loads(r.stdout.strip().splitlines()[-1])

    def wait_listening(self, port: int, timeout: float = 10, ns: Optional[str] = None) -> None:
        ns = ns or self.server_ns
        wait_for(lambda: self.run(ns, ["ss", "-Hltn", f"sport = :{port}"]).stdout.strip(),
                 guest_timeout(timeout), 0.05, f"a listener on port {port}")


@dataclass(frozen=True)
class ClientLink:
    """One more client namespace and its veth pair (``Testbed.add_client``)."""
    ns: str
    server_if: str
    client_if: str
    server_v4: ipaddress.IPv4Address
    client_v4: ipaddress.IPv4Address
    server_v6: ipaddress.IPv6Address
    client_v6: ipaddress.IPv6Address


PY = sys.executable


FLOWPACER = (PY, "-m", "flowpacer")


class DaemonExited(AssertionError):
    """The daemon exited while it was expected to run; the message ends with its log."""


class Daemon:
    """One ``flowpacer run`` process in ``tb``'s server namespace, its files in ``workdir``
    (a new temporary directory when None): ``rules.yaml``, ``control.sock``, ``daemon.log``.

    ``rules`` is the rules text; it may name the server interface ``IFACE`` and the backend
    ``BACKEND`` (replaced by ``tb.server_if`` and ``backend``). With ``rules=None`` the file
    ``rules_file`` or an existing ``workdir/rules.yaml`` is used as it is (a restart).

    ``extra`` are more ``run`` options; ``verbose`` adds ``-v``; ``command`` replaces
    ``python -m flowpacer`` (an installed ``bin/flowpacer``, a sandbox wrapper);
    ``log_mode="a"`` appends to the log (a restart in the same work directory).
    """

    def __init__(self, tb, workdir=None, rules: Optional[str] = None, *extra: str,
                 backend: str = "htb", verbose: bool = True, command: Sequence[str] = FLOWPACER,
                 log_mode: str = "w", env: Optional[dict] = None, rules_mode: int = 0o644,
                 rules_file=None):
        self.tb = tb
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="fp-d-"))
        self.rules = Path(rules_file) if rules_file is not None else self.workdir / "rules.yaml"
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

    def status(self, timeout: float = 60) -> dict:
        return self.call({"cmd": "status"}, timeout=timeout)

    def try_status(self, timeout: float = 30) -> Optional[dict]:
        """The status, or None when the control socket does not answer."""
        try:
            return self.status(timeout=timeout)
        except FlowpacerError:
            return None

    def flows(self) -> list:
        return self.status()["flows"]

    def settled_flows(self, handshakes: int = 1) -> list:
        """The flows once their classes do not change any more, else []: the first-byte program
        (when on) decided at least ``handshakes`` handshakes and every class it claimed is
        bound to its flow or released. Until then a flow the tracer's event placed first may
        still be rebound to the pool class its packets already use (ci33, ci of f3f0d43)."""
        st = self.status()
        fb = st.get("first_byte")
        if fb is not None:
            c = fb["counters"]
            if c["claimed"] + c["stopgap"] + c["missed"] < handshakes or \
                    c["bound"] + c["released"] + c["stale"] < c["claimed"]:
                return []
        return st["flows"]

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


def server_argv(ports: Sequence[int], name: str = "fp-demo-srv", v6: bool = False,
                mark: int = 0, priority: int = 0) -> List[str]:
    return [PY, "-m", "harness.blaster", "serve", "--name", name,
            "--ports", ",".join(map(str, ports))] + (["--v6"] if v6 else []) + (
                ["--mark", hex(mark)] if mark else []) + (
                ["--priority", hex(priority)] if priority else [])


def client_argv(host: str, port: int, seconds: float, warmup: float = 1.0,
                name: str = "fp-client", local_port: int = 0) -> List[str]:
    return [PY, "-m", "harness.blaster", "fetch", "--host", host, "--port", str(port),
            "--seconds", str(seconds), "--warmup", str(warmup), "--name", name,
            "--local-port", str(local_port)]


CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def in_netns(name: str):
    """Run the calling thread inside network namespace ``name`` for the ``with`` block."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)
