"""Real servers in a testbed's server namespace, configured in a work directory of their own.

    ng = Nginx(tb, tmp_path / "nginx", files={"big": 64 << 20, "small": 256 << 10}).start()
    ng.v4_port, ng.dual_port, ng.h2_port          # listeners (see Nginx's docstring)
    iperf3_server(tb, 5201); rsync_daemon(tb, tmp_path / "rsync", {"big": 32 << 20})

Every process is started through ``tb.popen`` (its own process group, killed when the testbed
is destroyed).
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, Optional

from harness.testbed import server_argv


def make_files(root: Path, files: Dict[str, int]) -> None:
    """Files of the given sizes under ``root`` (sparse: reading them costs no disk)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, size in files.items():
        with open(root / name, "wb") as f:
            f.truncate(size)


# the configuration's head, up to the http block's servers (harness/accesssrv.py adds its own)
NGINX_HEAD = """\
daemon off;
master_process on;
worker_processes {workers};
user root;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    sendfile on;
    keepalive_timeout 30s;
    keepalive_requests 10000;
    default_type application/octet-stream;
"""
NGINX_CONF = NGINX_HEAD + """\
    server {{
        listen {v4}:{port};
        listen [{v6}]:{port};
        listen [::]:{dual_port} ipv6only=off;
        listen {v4}:{h2_port} http2;
        listen [{v6}]:{h2_port} http2;
        root {dir}/www;
    }}
}}
"""


class Nginx:
    """nginx with 2 worker processes (comm ``nginx``) and three kinds of listener:

    - ``port`` on the server's IPv4 and on its IPv6 address (two sockets);
    - ``dual_port`` on ``[::]`` with ``ipv6only=off``: IPv4 clients arrive as IPv4-mapped
      IPv6 flows (``::ffff:10.77.x.2``);
    - ``h2_port`` on both addresses speaking HTTP/2 over cleartext (h2load's prior knowledge).
    """

    def __init__(self, tb, workdir: Path, files: Dict[str, int], port: int = 8080,
                 dual_port: int = 8081, h2_port: int = 8082):
        self.tb = tb
        self.dir = Path(workdir)
        self.port, self.dual_port, self.h2_port = port, dual_port, h2_port
        self.files = dict(files)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Nginx":
        for sub in ("tmp", "www"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        make_files(self.dir / "www", self.files)
        conf = self.dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=self.dir, workers=2, v4=self.tb.server_v4, v6=self.tb.server_v6,
                                          port=self.port, dual_port=self.dual_port,
                                          h2_port=self.h2_port))
        t = self.tb.run(self.tb.server_ns, ["nginx", "-t", "-q", "-c", str(conf)], check=False)
        if t.returncode != 0:
            raise AssertionError(f"nginx -t: {t.stderr.strip()}")
        self.proc = self.tb.popen(self.tb.server_ns, ["nginx", "-c", str(conf)],
                                  stderr=open(self.dir / "stderr.log", "w"))
        for p in (self.port, self.dual_port, self.h2_port):
            self.tb.wait_listening(p)
        return self

    def worker_pids(self):
        out = subprocess.run(["pgrep", "-P", str(self._master_pid()), "nginx"], capture_output=True,
                             text=True).stdout.split()
        return [int(x) for x in out]

    def _master_pid(self) -> int:
        return int((self.dir / "nginx.pid").read_text().split()[0])

    def error_log(self) -> str:
        try:
            return (self.dir / "error.log").read_text(errors="replace")
        except OSError:
            return ""


def iperf3_server(tb, port: int = 5201, bind: str = "", json: bool = False,
                  bind_dev: str = "") -> subprocess.Popen:
    """``iperf3 -s`` (serves one test after another) in the server namespace; a dual-stack
    listener (IPv4 clients are IPv4-mapped flows) unless ``bind`` names an address. ``json``:
    its own reports in JSON (a client's ``--get-server-output`` then has
    ``server_output_json``: what the server received, measured where it arrives).
    ``bind_dev``: the listener bound to that device (SO_BINDTODEVICE; a VRF's: it serves
    that VRF)."""
    p = tb.popen(tb.server_ns, ["iperf3", "-s", "-p", str(port), *(["-B", bind] if bind else []),
                                *(["--bind-dev", bind_dev] if bind_dev else []),
                                *(["-J"] if json else [])])
    tb.wait_listening(port)
    return p


RSYNCD_CONF = """\
use chroot = no
pid file = {dir}/rsyncd.pid
log file = {dir}/rsyncd.log
uid = root
gid = root
[data]
    path = {dir}/data
    read only = yes
"""


def rsync_daemon(tb, workdir: Path, files: Dict[str, int], port: int = 8730) -> subprocess.Popen:
    """``rsync --daemon --no-detach`` (IPv4 and IPv6 listeners) with one read-only module
    ``data`` holding ``files``."""
    d = Path(workdir)
    make_files(d / "data", files)
    conf = d / "rsyncd.conf"
    conf.write_text(RSYNCD_CONF.format(dir=d))
    p = tb.popen(tb.server_ns, ["rsync", "--daemon", "--no-detach", f"--config={conf}",
                                f"--port={port}"])
    tb.wait_listening(port)
    return p


def blaster_server(tb, ports, name: str = "fp-test-srv", v6: bool = False,
                   mark: int = 0) -> subprocess.Popen:
    """flowpacer's own delivery server (``harness.blaster serve``) on ``ports`` (``mark``: the
    SO_MARK of its listeners, so of every flow it accepts)."""
    p = tb.popen(tb.server_ns, server_argv(list(ports), name, v6=v6, mark=mark))
    for port in ports:
        tb.wait_listening(port)
    return p


__all__ = ["Nginx", "iperf3_server", "rsync_daemon", "blaster_server", "make_files"]
