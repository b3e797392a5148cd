"""A two-host network-namespace testbed (used by ``make demo`` and the tests).

    namespace SERVER  [ifname 10.77.x.1/24 fd77:x::1/64] ==veth== [peer 10.77.x.2 fd77:x::2]  namespace CLIENT

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
import socket
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence


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


class Testbed:
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
        for ns in (self.server_ns, self.client_ns):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.server_ns, "link", "add", self.server_if, "type", "veth",
           "peer", "name", self.client_if, "netns", self.client_ns)
        for ns, ifn, v4, v6 in ((self.server_ns, self.server_if, self.server_v4, self.server_v6),
                                (self.client_ns, self.client_if, self.client_v4, self.client_v6)):
            sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", ifn)
            sh("ip", "-n", ns, "addr", "add", f"{v6}/64", "dev", ifn, "nodad")
            sh("ip", "-n", ns, "link", "set", ifn, "up")
            if not self.gso:
                sh("ip", "-n", ns, "link", "set", ifn, "gso_max_segs", "1", check=False)

    def destroy(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait(timeout=5)
        self._procs.clear()
        for ns in (self.server_ns, self.client_ns):
            sh("ip", "netns", "del", ns, check=False)

    # --------------------------------------------------------------- running
    def popen(self, ns: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process inside a namespace, in its own process group (killed on destroy)."""
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, ns: str, argv: Sequence[str], timeout: float = 60, check: bool = True):
        return sh("ip", "netns", "exec", ns, *argv, timeout=timeout, check=check)

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
                 timeout, 0.05, f"a listener on port {port}")


PY = sys.executable


def server_argv(ports: Sequence[int], name: str = "fp-demo-srv", v6: bool = False) -> List[str]:
    return [PY, "-m", "flowpacer.tools.blaster", "serve", "--name", name,
            "--ports", ",".join(map(str, ports))] + (["--v6"] if v6 else [])


def client_argv(host: str, port: int, seconds: float, warmup: float = 1.0,
                name: str = "fp-client", local_port: int = 0) -> List[str]:
    return [PY, "-m", "flowpacer.tools.blaster", "fetch", "--host", host, "--port", str(port),
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
