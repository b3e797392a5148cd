"""The systemd unit and tools/install.sh.

- install.sh runs for real into a temporary prefix (a working venv, the unit with its paths
  rewritten, the rules, DKMS through a stand-in that fails its build), twice (idempotent);
  `systemd-analyze verify` then checks the installed unit, whose ExecStart exists and runs.
- There is no systemd as PID 1 here, so the unit's sandbox is rebuilt from the unit file itself
  and the real daemon runs in it: the capability bounding set, no-new-privs, systemd's seccomp
  filters (SystemCallFilter + SystemCallErrorNumber, MemoryDenyWriteExecute,
  RestrictAddressFamilies, the same rules systemd compiles, through libseccomp), read-only
  /sys, /proc/sys and file system with only the runtime directory writable, private /tmp,
  hidden /home, and the sd_notify protocol. In it the daemon must attach its tracer, attribute
  and shape flows of another user's process (found by the tracer and by sock_diag + /proc),
  reload on SIGHUP with RELOADING=1/READY=1, serve metrics, and clean up on SIGTERM.
"""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import textwrap
import urllib.parse
import urllib.request

import pytest

from flowpacer.surfaces.control import call
from harness.promql import promql_names
from harness.daemon import RULES, Daemon
from harness.testbed import PY, client_argv, in_netns, server_argv, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "systemd", "flowpacer.service")
INSTALL = os.path.join(ROOT, "tools", "install.sh")


def parse_unit(path=UNIT):
    """{(section, key): [values in order]} (comments and blank lines dropped)."""
    out, section = {}, None
    for line in open(path):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault((section, k.strip()), []).append(v.strip())
    return out


def one(unit, key, section="Service"):
    vals = unit.get((section, key))
    assert vals and len(vals) == 1, f"{key}= should be set once in [{section}]: {vals}"
    return vals[0]


# ------------------------------------------------------------------ static checks

def test_unit_says_what_the_daemon_needs():
    u = parse_unit()
    assert one(u, "Type") == "notify"
    assert one(u, "ExecStart") == "/opt/flowpacer/bin/flowpacer run --rules /etc/flowpacer/rules.yaml"
    # a refused reload fails `systemctl reload` (flowpacer reload exits 2; kill -HUP cannot)
    assert one(u, "ExecReload") == "/opt/flowpacer/bin/flowpacer reload"
    assert one(u, "Restart") == "on-failure" and one(u, "RestartPreventExitStatus") == "2"
    pre = one(u, "ExecStartPre")
    assert pre.lstrip("-+") == "/sbin/modprobe sch_psp" and "-" in pre[:2]    # failure harmless
    assert one(u, "RuntimeDirectory") == "flowpacer" and one(u, "RuntimeDirectoryMode") == "0700"
    assert one(u, "ProtectSystem") == "strict"
    # the directives that would break the daemon stay off (see the comments in the unit)
    for key in ("ProtectKernelModules", "ProtectProc", "ProcSubset", "PrivateNetwork", "PrivateUsers",
                "User", "DynamicUser"):
        assert (("Service", key)) not in u, key


def test_install_script_syntax():
    r = subprocess.run(["bash", "-n", INSTALL], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def project_dependencies():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def project_extras():
    """Optional extras other than ``test`` (e.g. ``web``: bcrypt, imported only when configured)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"].get("optional-dependencies", {})
    return [d for k, v in extras.items() if k != "test" for d in v]


def test_every_third_party_import_is_a_declared_dependency():
    """pip installs only what pyproject.toml declares: anything else the package imports would
    make the installed service fail at start (bcc is Debian's python3-bpfcc, optional)."""
    import ast
    import importlib.metadata as md
    import sys
    declared = {re.split(r"[<>=!~;\[ ]", d, 1)[0].lower().replace("_", "-")
                for d in project_dependencies() + project_extras()}
    dists = md.packages_distributions()
    missing = {}
    pkg = os.path.join(ROOT, "flowpacer")
    for dirpath, _dirs, files in os.walk(pkg):
        if os.path.relpath(dirpath, pkg).split(os.sep)[:2] == ["kernel", "kmod"]:
            continue          # the module's sources (sch-psp-dkms)
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                for m in mods:
                    top = m.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("flowpacer", "bcc"):
                        continue
                    names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
                    if not names & declared:
                        missing.setdefault(top, set()).add(os.path.relpath(path, ROOT))
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"


FAKE_DKMS = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/dkms.calls"
[ "$1" = build ] && { echo "make: *** kernel headers missing" >&2; exit 10; }
exit 0
"""


def wheelhouse(dest):
    """Wheels of the project's dependencies (and theirs), repacked from this venv's installed
    distributions: install.sh can then run without any network, with the tested versions."""
    import base64
    import csv
    import hashlib
    import importlib.metadata as md
    import io
    import zipfile
    from packaging.requirements import Requirement
    dest.mkdir()
    todo = [Requirement(r) for r in project_dependencies()]
    done = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        dist = md.distribution(req.name)
        name = dist.metadata["Name"]
        if name.lower() in done:
            continue
        done.add(name.lower())
        todo += [Requirement(r) for r in dist.requires or []]
        if dist.files is None:
            # a Debian package's egg-info (no file list): install.sh's venv sees it too
            # (--system-site-packages), so pip needs no wheel of it
            continue
        info = next(f for f in dist.files if f.parts[0].endswith(".dist-info"))
        tag = next(l.split(":", 1)[1].strip() for l in dist.read_text("WHEEL").splitlines()
                   if l.startswith("Tag:"))
        whl = dest / f"{name.replace('-', '_')}-{dist.version}-{tag}.whl"
        record = io.StringIO()
        w = csv.writer(record, lineterminator="\n")
        with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
            for f in dist.files:
                if f.parts[0] == ".." or f.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json") \
                        or "__pycache__" in f.parts:
                    continue
                data = f.locate().read_bytes()
                z.writestr(str(f), data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                w.writerow([str(f), f"sha256={digest}", len(data)])
            w.writerow([f"{info.parts[0]}/RECORD", "", ""])
            z.writestr(f"{info.parts[0]}/RECORD", record.getvalue())
    return dest


def test_install_into_a_temp_prefix_twice_then_verify_the_unit(testbed, tmp_path):
    """Offline: in a network namespace of its own, PIP_NO_INDEX=1, the dependencies from a
    wheelhouse of the versions the tests run with."""
    fake = tmp_path / "fake-dkms"
    fake.write_text(FAKE_DKMS)
    fake.chmod(0o755)
    prefix, conf, units, usrsrc = (tmp_path / "opt/flowpacer", tmp_path / "etc/flowpacer",
                                   tmp_path / "etc/systemd/system", tmp_path / "usr/src")
    env = dict(os.environ, PREFIX=str(prefix), CONFDIR=str(conf), UNITDIR=str(units), DKMS="yes",
               DKMS_CMD=str(fake), DKMS_SRCDIR=str(usrsrc), SYSTEMCTL="no", PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(wheelhouse(tmp_path / "wheels")))
    env.pop("DESTDIR", None)
    install = ["ip", "netns", "exec", testbed.server_ns, "bash", INSTALL]
    before = set(os.listdir(ROOT))

    r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"venv {prefix}: made (--system-site-packages)" in r.stdout
    assert "include-system-site-packages = true" in (prefix / "pyvenv.cfg").read_text()
    # the venv works from anywhere, with Debian's bcc and this checkout's code
    out = subprocess.run([str(prefix / "bin/python"), "-c",
                          "import bcc, flowpacer.surfaces.edit, flowpacer.surfaces.top; print(flowpacer.surfaces.edit.__file__)"],
                         cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith(str(prefix)), out.stderr
    # the rules: the example, root:root 0644, valid
    rules = conf / "rules.yaml"
    st = rules.stat()
    assert rules.read_text() == open(os.path.join(ROOT, "rules/example.yaml")).read()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o644)
    chk = subprocess.run([str(prefix / "bin/flowpacer"), "rules", "check", str(rules)],
                         capture_output=True, text=True, timeout=60)
    assert chk.returncode == 0, chk.stderr
    # the unit: the shipped one with only its paths moved
    unit = units / "flowpacer.service"
    want = open(UNIT).read().replace("/opt/flowpacer/", f"{prefix}/").replace("/etc/flowpacer/", f"{conf}/")
    assert unit.read_text() == want and stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert f"ExecStart={prefix}/bin/flowpacer run --rules {conf}/rules.yaml" in want
    # DKMS: sources copied (no build products), add + build tried, the failure reported, not fatal
    assert (tmp_path / "dkms.calls").read_text().splitlines() == [
        "status -m sch_psp -v 0.1.0", "add -m sch_psp -v 0.1.0", "build -m sch_psp -v 0.1.0"]
    src = usrsrc / "sch_psp-0.1.0"
    assert (src / "dkms.conf").exists() and (src / "sch_psp.c").exists()
    assert not list(src.glob("*.ko")) and not list(src.glob("*.o"))
    assert "dkms build sch_psp/0.1.0 failed (not fatal" in r.stderr and "kernel headers missing" in r.stderr

    # systemd's own check of the installed unit (its ExecStart really exists): no complaint
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    assert v.returncode == 0 and v.stdout.strip() == "" and v.stderr.strip() == "", v.stdout + v.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for flowpacer.service: ([\d.]+)", sec.stdout)
    assert m and float(m.group(1)) <= 3.5, sec.stdout[-3000:]

    # the installed ExecStart really runs the daemon (with the venv's dependencies)
    (tmp_path / "installed").mkdir()
    d = Daemon(testbed, tmp_path / "installed", "interface: IFACE\nbackend: htb\nlink_rate: 1gbit\nrules: []\n",
               "--no-tracer", verbose=False, command=[str(prefix / "bin/flowpacer")]).start(timeout=30)
    assert d.status()["backend"] == "htb"
    assert d.stop(timeout=30) == 0

    # again: nothing clobbered, the venv kept, the user's rules kept
    rules.write_text(rules.read_text() + "# mine\n")
    cfg_ino = (prefix / "pyvenv.cfg").stat().st_ino
    env["DKMS"] = "no"
    r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"venv {prefix}: kept" in r.stdout and "unchanged" in r.stdout and "kept as they are" in r.stdout
    assert (prefix / "pyvenv.cfg").stat().st_ino == cfg_ino
    assert rules.read_text().endswith("# mine\n")
    assert set(os.listdir(ROOT)) == before                      # nothing written into the checkout


# ------------------------------------------------------------------ the sandbox, for real

SANDBOX = r'''
"""Rebuild a systemd unit's sandbox (config: JSON in argv[1]), then exec argv[2:]."""
import ctypes, errno, json, mmap, os, socket, subprocess, sys
cfg = json.loads(sys.argv[1])
argv = sys.argv[2:]

def mount(*args):
    subprocess.run(["mount", *args], check=True)

# `ip netns exec` gave us a mount namespace of our own (a slave of the host's) with a fresh
# /sys: mount tracefs the way sys-kernel-tracing.mount does on the host
mount("-t", "tracefs", "nodev", "/sys/kernel/tracing")
hidden = (["/tmp", "/var/tmp"] if cfg["private_tmp"] else []) + \
    ([d for d in ("/home", "/root", "/run/user") if os.path.isdir(d)] if cfg["protect_home"] else [])
# the program: installed under /opt in production, here the checkout and its venv, which may sit
# below a directory the sandbox hides (a CI clone in /tmp): keep it and bind it back, read-only
progs = [(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in cfg["program_dirs"]
         if any(p == h or p.startswith(h + "/") for h in hidden)]
if cfg["private_tmp"]:
    for d in ("/tmp", "/var/tmp"):
        mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", d)
if cfg["protect_home"]:
    for d in ("/home", "/root", "/run/user"):
        if os.path.isdir(d):
            mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", d)
libc = ctypes.CDLL(None, use_errno=True)
for p, fd in progs:
    os.makedirs(p, exist_ok=True)
    # mount(2), not mount(8): the tool would resolve the fd's link to the (now hidden) path name
    if libc.mount(f"/proc/self/fd/{fd}".encode(), p.encode(), None, 4096, None) != 0:  # MS_BIND
        raise OSError(ctypes.get_errno(), f"bind {p}")
    mount("-o", "remount,bind,ro", p)
if cfg["protect_home"]:
    for d in ("/home", "/root", "/run/user"):
        if os.path.isdir(d):
            mount("-o", "remount,ro", d)
for d in cfg["rw_paths"]:
    mount("--bind", d, d)
if cfg["protect_system_strict"]:
    skip = ("/proc", "/sys", "/dev", "/tmp", "/var/tmp", *cfg["rw_paths"])
    points = [line.split()[4] for line in open("/proc/self/mountinfo")]
    for p in sorted(set(points)):
        p = p.replace("\\040", " ")
        if any(p == s or p.startswith(s.rstrip("/") + "/") for s in skip):
            continue
        if p in ("/home", "/root", "/run/user") and cfg["protect_home"]:
            continue
        subprocess.run(["mount", "-o", "remount,bind,ro", p], check=False,
                       stderr=subprocess.DEVNULL)
if cfg["protect_kernel_tunables"]:
    mount("--bind", "/proc/sys", "/proc/sys")
    mount("-o", "remount,bind,ro", "/proc/sys")
    points = [line.split()[4] for line in open("/proc/self/mountinfo")]
    for p in sorted(set(points)):
        if p == "/sys" or p.startswith("/sys/"):
            mount("-o", "remount,bind,ro", p)

import seccomp
if cfg["mdwe"]:             # what systemd's seccomp_memory_deny_write_execute() installs
    g = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    W, X = mmap.PROT_WRITE, mmap.PROT_EXEC
    g.add_rule(seccomp.ERRNO(errno.EPERM), "mmap", seccomp.Arg(2, seccomp.MASKED_EQ, W | X, W | X))
    for sc in ("mprotect", "pkey_mprotect"):
        g.add_rule(seccomp.ERRNO(errno.EPERM), sc, seccomp.Arg(2, seccomp.MASKED_EQ, X, X))
    g.add_rule(seccomp.ERRNO(errno.EPERM), "shmat", seccomp.Arg(2, seccomp.MASKED_EQ, 0o100000, 0o100000))
    g.load()
if cfg["families"]:         # RestrictAddressFamilies=: others get EAFNOSUPPORT
    h = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for fam in range(0, 64):
        if fam not in cfg["families"]:
            h.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.EQ, fam))
    h.load()
# SystemCallFilter= (last: it does not allow seccomp(2) itself)
f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(getattr(errno, cfg["syscall_errno"])))
for name in cfg["syscalls"]:
    try:
        f.add_rule(seccomp.ALLOW, name)
    except Exception:        # not a syscall of this architecture
        pass
f.load()

# the filters are in force (we still hold every capability here)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mount(b"none", b"/mnt", b"tmpfs", 0, None) == -1 and ctypes.get_errno() == errno.EPERM
if cfg["mdwe"]:
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        raise SystemExit("sandbox: W+X mapping allowed")
    except PermissionError:
        pass
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raise SystemExit("sandbox: AF_PACKET allowed")
except OSError as e:
    assert e.errno == errno.EAFNOSUPPORT, e
os.execvp(argv[0], argv)
'''

FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_DAC_READ_SEARCH": 2, "CAP_BPF": 39,
        "CAP_PERFMON": 38, "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24}


def syscall_set(spec):
    """The syscalls a SystemCallFilter= allow list names (groups resolved by systemd itself)."""
    names, seen = set(), set()

    def resolve(item):
        if not item.startswith("@"):
            names.add(item)
            return
        if item in seen:
            return
        seen.add(item)
        out = subprocess.run(["systemd-analyze", "syscall-filter", item], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        for line in out.splitlines()[1:]:
            t = line.strip()
            if t and not t.startswith("#"):
                resolve(t)
    for item in spec.split():
        resolve(item)
    return sorted(names)


def sandbox_config(u, rw_paths):
    assert not one(u, "SystemCallFilter").startswith("~"), "expected an allow list"
    return {
        "program_dirs": [ROOT],
        "private_tmp": one(u, "PrivateTmp") == "yes",
        "protect_home": one(u, "ProtectHome") == "yes",
        "protect_system_strict": one(u, "ProtectSystem") == "strict",
        "protect_kernel_tunables": one(u, "ProtectKernelTunables") == "yes",
        "rw_paths": rw_paths,
        "syscalls": syscall_set(one(u, "SystemCallFilter")),
        "syscall_errno": one(u, "SystemCallErrorNumber"),
        "mdwe": one(u, "MemoryDenyWriteExecute") == "yes",
        "families": [FAMILIES[f] for f in one(u, "RestrictAddressFamilies").split()],
    }


class Notify:
    """The NOTIFY_SOCKET end of sd_notify: what systemd would receive."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.got = []

    def states(self):
        while True:
            try:
                self.got.append(self.sock.recv(4096).decode())
            except (socket.timeout, BlockingIOError):
                return self.got

    def saw(self, *wanted):
        """The messages so far contain the ``wanted`` states in this order."""
        lines = [l for m in self.states() for l in m.splitlines()]
        i = 0
        for l in lines:
            if i < len(wanted) and l == wanted[i]:
                i += 1
        return i == len(wanted)


SANDBOX_RULES = """\
interface: {iface}
backend: htb
link_rate: 1gbit
rules:
  - name: slow
    match: {{process: fp-test-srv, direction: inbound, local_port: 9101}}
    rate: {rate}
"""


def _caps_of(pid):
    st = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
    return {k: v.strip() for k, v in st.items()}


def test_the_daemon_works_in_the_units_sandbox(testbed, tmp_path):
    try:
        import seccomp  # noqa: F401
    except ImportError:
        pytest.fail("python3-seccomp is needed to rebuild the unit's seccomp filters "
                    "(apt-get install python3-seccomp)")
    u = parse_unit()
    caps = one(u, "CapabilityBoundingSet").split()
    assert one(u, "NoNewPrivileges") == "yes"
    # the runtime directory, as RuntimeDirectory= makes it: the only writable place
    run = f"/run/fp-test-{secrets.token_hex(3)}"
    os.mkdir(run, 0o700)
    try:
        # the daemon's rules file, control socket and log in it
        d = Daemon(testbed, run, SANDBOX_RULES.format(iface=testbed.server_if, rate="10mbit"),
                   verbose=False)
        rules, sock = str(d.rules), d.sock
        notify = Notify(os.path.join(run, "notify"))
        wrapper = tmp_path / "sandbox.py"
        wrapper.write_text(SANDBOX)
        cfg = sandbox_config(u, [run])

        # a server of another user, and a flow that exists before the daemon starts
        testbed.popen(testbed.server_ns, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                          "--", *server_argv([9101], "fp-test-srv")])
        testbed.wait_listening(9101)
        host = str(testbed.server_v4)
        testbed.popen(testbed.client_ns, client_argv(host, 9101, 40, local_port=45001))
        wait_for(lambda: ":45001" in testbed.run(testbed.server_ns,
                                                 ["ss", "-Htn", "state", "established"]).stdout,
                 10, 0.05, "the first flow")

        d.command = [PY, str(wrapper), json.dumps(cfg),
                     "setpriv", "--bounding-set=-all," + ",".join("+" + c[4:].lower() for c in caps),
                     "--inh-caps=-all", "--no-new-privs", "--", PY, "-m", "flowpacer"]
        d.env = dict(os.environ, NOTIFY_SOCKET=notify.path, INVOCATION_ID="x")
        daemon = d.start(wait=False).proc

        def ready():
            if daemon.poll() is not None:
                raise AssertionError(f"daemon exited {daemon.returncode}:\n{d.log_text()}")
            return notify.saw("READY=1")
        wait_for(ready, 60, 0.05, "READY=1 from the daemon")

        # it holds exactly the unit's capabilities, no-new-privs, under seccomp filters
        st = _caps_of(daemon.pid)
        want = sum(1 << CAPS[c] for c in caps)
        assert int(st["CapEff"], 16) == want and int(st["CapBnd"], 16) == want, st
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st

        status = call(sock, {"cmd": "status"})
        assert status["flow_source"].startswith("tracer"), status["flow_source"]
        # the flow that was there before: found by sock_diag, its owner through /proc
        f1 = wait_for(lambda: [f for f in call(sock, {"cmd": "status"})["flows"]
                               if f["remote"].endswith(":45001")], 10, 0.05, "the earlier flow")[0]
        assert (f1["rule"], f1["process"], f1["uid"], f1["source"]) == \
            ("slow", "fp-test-srv", 65534, "reconcile")
        assert f1["pid"] > 0
        # a new flow: seen by the tracer
        testbed.popen(testbed.client_ns, client_argv(host, 9101, 40, local_port=45002))
        f2 = wait_for(lambda: [f for f in call(sock, {"cmd": "status"})["flows"]
                               if f["remote"].endswith(":45002")], 10, 0.05, "the new flow")[0]
        assert (f2["rule"], f2["process"], f2["source"]) == ("slow", "fp-test-srv", "tracer")
        assert f2["rate_bit"] == 10_000_000

        # ExecReload: SIGHUP, with RELOADING=1 ... READY=1
        with open(rules, "w") as f:
            f.write(SANDBOX_RULES.format(iface=testbed.server_if, rate="20mbit"))
        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: notify.saw("READY=1", "RELOADING=1", "READY=1"), 10, 0.05, "RELOADING=1, READY=1")
        wait_for(lambda: all(f["rate_bit"] == 20_000_000 for f in call(sock, {"cmd": "status"})["flows"]),
                 5, 0.05, "the new rate")

        # the Prometheus endpoint (AF_INET, a thread of its own) answers
        with in_netns(testbed.server_ns):
            body = urllib.request.urlopen("http://127.0.0.1:9717/metrics", timeout=10).read().decode()
        assert re.search(r'^flowpacer_flow_sent_bytes_total\{.*rule="slow".*\} [1-9]', body, re.M), \
            body[:2000]

        # SIGTERM: STOPPING=1, everything removed, exit 0
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        assert notify.saw("READY=1", "STOPPING=1")
        qd = testbed.run(testbed.server_ns, ["tc", "qdisc", "show", "dev", testbed.server_if]).stdout
        assert "f1f0:" not in qd, qd
        text = d.log_text()
        assert "Traceback" not in text and "ERROR" not in text, text
    finally:
        d.stop()
        shutil.rmtree(run, ignore_errors=True)


# ------------------------------------------------------------------ the Grafana dashboard

DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
# the metrics the daemon exports (flowpacer/surfaces/metrics.py) that the dashboard may use
METRICS = {
    "flowpacer_flow_sent_bytes_total", "flowpacer_flow_target_rate_bytes_per_second",
    "flowpacer_rule_sent_bytes_total", "flowpacer_rule_flows", "flowpacer_flow_dropped_packets_total",
    "flowpacer_apply_duration_seconds_bucket", "flowpacer_events_total",
    "flowpacer_tracer_lost_events_total", "flowpacer_netlink_errors_total", "flowpacer_reloads_total",
    "flowpacer_flow_series_overflow",
    # health, stages, flow source (issue 28)
    "flowpacer_backend_state", "flowpacer_backend_fallback", "flowpacer_flow_source_degraded",
    "flowpacer_build_info", "flowpacer_stage_state", "flowpacer_stage_failures_total",
    "flowpacer_class_ids_used", "flowpacer_class_ids_limit",
    # uploads and caps
    "flowpacer_rule_received_bytes_total", "flowpacer_rule_group_rate_bytes_per_second",
    "flowpacer_rule_total_rate_bytes_per_second", "flowpacer_client_sent_bytes_total",
    "flowpacer_client_series_overflow",
}
# panels with nothing to show unless a rule has receive_rate, total_rate or client_rate (the
# test's rules have none): their queries must still be valid PromQL
NEEDS_CAPS_OR_UPLOADS = {"Received per rule (uploads)", "Rule caps (total_rate)",
                         "Clients (top 10, client_rate)"}
FLOW_LABELS = {"rule", "process", "direction", "local_address", "local_port", "remote_address",
               "remote_port"}
LABELS = FLOW_LABELS | {"instance", "job", "le", "source", "kind", "outcome", "state", "stage",
                        "side", "client", "version", "interface"}
GRAFANA_VARS = {"$__rate_interval": "5s", "$__range": "1m", "$instance": ".*", "$rule": ".*"}

def dashboard_targets():
    d = json.load(open(DASHBOARD))
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p, t))
    walk(d["panels"])
    return d, out


def test_dashboard_uses_only_exported_metrics_and_labels():
    d, targets = dashboard_targets()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    # the data source is a dashboard variable, so the file works imported by hand and under
    # Grafana's file provisioning (where __inputs is not substituted)
    assert "__inputs" not in d and "${DS_PROMETHEUS}" not in json.dumps(d)
    ds = d["templating"]["list"][0]
    assert (ds["name"], ds["type"], ds["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    used = set()
    assert len(targets) >= 12
    for p, t in targets:
        assert t["datasource"]["uid"] == "${datasource}", p["title"]
        metrics, labels = promql_names(t["expr"])
        assert metrics and metrics <= METRICS, (p["title"], t["expr"], metrics - METRICS)
        assert labels <= LABELS, (p["title"], labels - LABELS)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        assert legend <= LABELS, (p["title"], legend - LABELS)
        used |= metrics
    for v in d["templating"]["list"][1:]:
        assert v["datasource"]["uid"] == "${datasource}", v["name"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"]["query"])
        metrics, labels = promql_names(m.group(1))
        assert metrics <= METRICS and labels | {m.group(2)} <= LABELS, v["name"]
    assert used == METRICS          # each panel asked for is there


def test_promql_names_parser():
    m, l = promql_names('topk(20, rate(flowpacer_x_total{instance=~"$i", rule!="a{b}"}[5m])) * 8 '
                        'and on(rule) flowpacer_y by (le)')
    assert m == {"flowpacer_x_total", "flowpacer_y"} and l == {"instance", "rule", "le"}


def _prom_query(expr):
    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        ans = json.loads(r.read())
    assert ans["status"] == "success", ans
    return ans["data"]["result"]


def test_dashboard_queries_against_prometheus_scraping_a_real_daemon(testbed, tmp_path):
    """A real Prometheus scrapes a real daemon shaping a real flow; every panel's query (Grafana
    variables substituted) must parse and return series, and the per-flow panel must show the
    flow at its rule's rate."""
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES, "--metrics-addresses", "full").start()
    try:
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 40, local_port=45001))
        wait_for(lambda: d.flows(), 10, 0.05, "the shaped flow")
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(textwrap.dedent("""\
            global: {scrape_interval: 1s, evaluation_interval: 1s}
            scrape_configs:
              - job_name: flowpacer
                static_configs: [{targets: ["127.0.0.1:9717"]}]
            """))
        testbed.popen(testbed.server_ns, ["prometheus", f"--config.file={cfg}",
                                          f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                          "--web.listen-address=127.0.0.1:9090", "--log.level=error"])
        _, targets = dashboard_targets()
        empty = []

        def sub(e):
            for k, v in GRAFANA_VARS.items():
                e = e.replace(k, v)
            return e

        def all_answer():
            with in_netns(testbed.server_ns):
                try:
                    empty[:] = [f"{p['title']}: {sub(t['expr'])}" for p, t in targets
                                if not _prom_query(sub(t["expr"]))
                                and p["title"] not in NEEDS_CAPS_OR_UPLOADS]
                except OSError as e:        # Prometheus not up yet
                    empty[:] = [f"Prometheus: {e}"]
            return not empty
        try:
            wait_for(all_answer, 30, 0.5, "every dashboard query to return series")
        except TimeoutError as e:
            raise AssertionError(f"{e}; without series: {empty}") from None
        # the per-flow panel: the flow at about its rule's 10 Mbit/s (once Prometheus has a full
        # rate window of it), the target exactly that
        (_, ta), (_, tb) = [(p, t) for p, t in targets if p["title"].startswith("Per-flow rate")]
        seen = []

        def flow_at_rate():
            with in_netns(testbed.server_ns):
                actual, target = _prom_query(sub(ta["expr"])), _prom_query(sub(tb["expr"]))
            seen[:] = [actual, target]
            return (len(actual) == 1 and len(target) == 1
                    and 8.5e6 <= float(actual[0]["value"][1]) <= 11e6)
        try:
            wait_for(flow_at_rate, 20, 0.5, "the per-flow panel to show the flow at its rate")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {seen}") from None
        actual, target = seen
        a = actual[0]["metric"]
        assert (a["rule"], a["process"], a["direction"], a["remote_port"]) == \
            ("slow", "fp-test-srv", "inbound", "45001")
        assert float(target[0]["value"][1]) == 10e6
        assert target[0]["metric"] == {k: v for k, v in a.items()}      # the same flow's series
        with in_netns(testbed.server_ns):
            label_values = json.loads(urllib.request.urlopen(
                "http://127.0.0.1:9090/api/v1/label/instance/values?match[]=flowpacer_reloads_total",
                timeout=10).read())["data"]
        assert label_values == ["127.0.0.1:9717"]               # the $instance variable's query
    finally:
        assert d.stop() == 0
