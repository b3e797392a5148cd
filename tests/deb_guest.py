"""Inside the test VM booted with systemd as PID 1 (fp.init=systemd): the Debian packages
installed and their unit driven as an admin would. Run by tests/test_deb.py:

    python tests/deb_guest.py DEBDIR        (DEBDIR: flowpacer_*.deb, sch-psp-dkms_*.deb, deps/*.deb)

Each step appends what it saw to $FLOWPACER_VM_OUT/deb_guest.json; the first failed check stops
the run with a one-line reason (exit 1), which the host test reports. The guest's root is the
host's under a tmpfs overlay: the install and everything else vanish at power-off.

Steps: dpkg -i (DKMS registers sch_psp's source; the guest has no kernel headers, so the module
the host built from the same source for the guest's kernel, FLOWPACER_PSP_KO, goes where DKMS
installs its builds: compiling it under TCG took minutes, and DKMS's build on Debian 12 and 13 is
tests/test_deb.py's chroot case); a two-namespace
testbed; the rules (psp, one rule per port) and a drop-in as an admin would write them
(NetworkNamespacePath= to the server's namespace, --no-tracer: bcc takes minutes to compile
under TCG); a flow that exists before the start; `systemctl start` (Type=notify: when it
returns, that flow must already be shaped); a measured flow at the rule's rate; `systemctl
reload` with a changed rate; kill -9 of the main process (Restart= brings it back, the live
flow keeps its class, no class is leaked); a hung main loop (its thread stopped with ptrace: the
watchdog kills the daemon and Restart= brings it back); `systemctl stop` (everything removed);
`systemd-analyze security flowpacer`.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.testbed import Testbed, client_argv, server_argv, wait_for  # noqa: E402

OUT = Path(os.environ.get("FLOWPACER_VM_OUT", "/tmp")) / "deb_guest.json"
RESULTS: dict = {}
SERVER = "fp-deb-srv"
PORT_LONG, PORT_MEASURE = 9101, 9102
RATE1, RATE2 = 3_000_000, 5_000_000          # bit/s of the rule before and after the reload
WIRE = 1448 / 1514                           # TCP payload per full frame (IPv4)


class Failed(Exception):
    pass


def record(key, value):
    RESULTS[key] = value
    OUT.write_text(json.dumps(RESULTS, indent=1, sort_keys=True))
    print(f"deb_guest: {key}: {json.dumps(value)[:300]}", flush=True)


def check(cond, why):
    if not cond:
        raise Failed(why)


def sh(*argv, timeout=120, check_rc=True):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check_rc and p.returncode != 0:
        raise Failed(f"{' '.join(argv)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}")
    return p


def show(*props):
    out = sh("systemctl", "show", "flowpacer.service", *[f"--property={p}" for p in props]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def status():
    p = sh("flowpacer", "status", "--json", timeout=60, check_rc=False)
    return json.loads(p.stdout) if p.returncode == 0 else None


def kernel_classes(tb):
    out = sh("tc", "-n", tb.server_ns, "class", "show", "dev", tb.server_if).stdout
    return {m.group(1) for m in re.finditer(r"^class \S+ (\S+)", out, re.M)}


def root_qdisc(tb):
    out = sh("tc", "-n", tb.server_ns, "qdisc", "show", "dev", tb.server_if).stdout
    m = re.search(r"^qdisc (\S+) \S+ root", out, re.M)
    return m.group(1) if m else None


def owned(st):
    """The classes the daemon says are its flows' (and their groups')."""
    return ({f["classid"] for f in st.get("flows", [])}
            | {g["classid"] for g in st.get("groups", []) if g.get("classid")})


def flow_on(st, port):
    return [f for f in (st or {}).get("flows", []) if f["local"].endswith(f":{port}")]


def journal():
    return sh("journalctl", "-u", "flowpacer.service", "--no-pager", "-o", "cat").stdout


def measure(tb, port, seconds=6.0):
    r = tb.run(tb.client_ns, client_argv(str(tb.server_v4), port, seconds, warmup=1.0),
               timeout=seconds + 60)
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_rules(tb, rate_bit):
    text = (f"interface: {tb.server_if}\nbackend: psp\nlink_rate: 1gbit\nrules:\n"
            f"  - name: long\n    match: {{process: {SERVER}, direction: inbound, local_port: {PORT_LONG}}}\n"
            f"    rate: {rate_bit}\n"
            f"  - name: measured\n    match: {{process: {SERVER}, direction: inbound, local_port: {PORT_MEASURE}}}\n"
            f"    rate: {rate_bit}\n")
    tmp = Path("/etc/flowpacer/.rules.yaml.test")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, "/etc/flowpacer/rules.yaml")


# Run as a separate process: it stops thread TID (only that thread: PTRACE_SEIZE +
# PTRACE_INTERRUPT) and stays its tracer until the process is a zombie (or a time limit), then
# exits, which detaches it: the real parent (systemd) is only told of the death once the tracer
# is gone.
HANG = r"""
import ctypes, sys, time
tid, limit = int(sys.argv[1]), float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for req in (0x4206, 0x4207):          # PTRACE_SEIZE, PTRACE_INTERRUPT
    if libc.ptrace(req, tid, None, None) != 0:
        sys.exit(f"ptrace {req:#x} of {tid}: errno {ctypes.get_errno()}")
print("stopped", flush=True)
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        state = open(f"/proc/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        break
    if state in ("Z", "X"):
        break
    time.sleep(0.2)
"""


def hang_thread(tid: int, limit_s: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HANG, str(tid), str(limit_s)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "stopped":
        p.wait(timeout=30)
        raise Failed(f"could not stop thread {tid}: {p.stderr.read().strip()}")
    return p


def main(debdir: Path):
    t0 = time.monotonic()
    record("pid1", Path("/proc/1/comm").read_text().strip())
    check(RESULTS["pid1"] == "systemd", "PID 1 is not systemd")

    # ---- install: dependencies (downloaded by the host from the archive), then the two packages
    debs = sorted(glob.glob(str(debdir / "deps" / "*.deb")))
    debs += [glob.glob(str(debdir / "flowpacer_*.deb"))[0], glob.glob(str(debdir / "sch-psp-dkms_*.deb"))[0]]
    # the postinst builds for every kernel whose headers it finds: hide every build link in this
    # guest (its root is a tmpfs overlay of the host's), so DKMS only registers the source, then
    # give the running kernel the module the host built (tests/test_deb.py: FLOWPACER_PSP_KO)
    kver = os.uname().release
    for build in glob.glob("/lib/modules/*/build"):
        os.unlink(build)
    t = time.monotonic()
    p = sh("dpkg", "-i", *debs, timeout=1200)
    record("install_s", round(time.monotonic() - t, 1))
    record("dkms_status", sh("dkms", "status", "sch_psp").stdout.strip())
    check("sch_psp/" in RESULTS["dkms_status"] and "added" in RESULTS["dkms_status"],
          "DKMS did not register sch_psp's source")
    # with depmod's indexes the host made for it (depmod here reads every module over 9p: minutes)
    moddir = Path(f"/lib/modules/{kver}")
    dest = moddir / "updates/dkms"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sch_psp.ko").write_bytes(Path(os.environ["FLOWPACER_PSP_KO"]).read_bytes())
    for f in Path(os.environ["FLOWPACER_MODULE_INDEX"]).glob("modules.*"):
        (moddir / f.name).write_bytes(f.read_bytes())
    record("module", sh("modinfo", "-n", "sch_psp").stdout.strip())
    check("/updates/dkms/" in RESULTS["module"], "modprobe would not load the module DKMS's way")
    vermagic = sh("modinfo", "-F", "vermagic", "sch_psp").stdout.split()
    check(vermagic[:1] == [kver], f"the module is for {vermagic[:1]}, not the guest's {kver}")
    check(sh("systemctl", "is-enabled", "flowpacer.service", check_rc=False).stdout.strip() == "disabled",
          "the unit is enabled by the install")
    check(show("ActiveState")["ActiveState"] == "inactive", "the install started the service")

    with Testbed(tag="deb") as tb:
        write_rules(tb, RATE1)
        dropin = Path("/etc/systemd/system/flowpacer.service.d/vm.conf")
        dropin.parent.mkdir(parents=True, exist_ok=True)
        dropin.write_text(
            "# the test's server namespace; sock_diag only (bcc compiles for minutes under TCG)\n"
            f"[Service]\nNetworkNamespacePath=/run/netns/{tb.server_ns}\nExecStart=\n"
            "ExecStart=/usr/bin/flowpacer run --rules /etc/flowpacer/rules.yaml --no-tracer --rescan 0.5\n"
            # ExecStopPost's `flowpacer cleanup` starts Python: under TCG on a loaded host that
            # took more than the unit's 30 s (a real server: well under a second)
            "TimeoutStopSec=150\n")
        sh("systemctl", "daemon-reload")
        tb.popen(tb.server_ns, server_argv([PORT_LONG, PORT_MEASURE], SERVER))
        tb.wait_listening(PORT_LONG, timeout=60)
        tb.wait_listening(PORT_MEASURE, timeout=60)
        # a flow that lives through the whole run, there before the daemon
        tb.popen(tb.client_ns, client_argv(str(tb.server_v4), PORT_LONG, 900, warmup=0.5))
        wait_for(lambda: tb.run(tb.server_ns, ["ss", "-Htn", "state", "established",
                                               f"sport = :{PORT_LONG}"]).stdout.strip(), 60, 0.2,
                 "the long flow")

        # ---- start: Type=notify, ready only once the first apply is done
        t = time.monotonic()
        sh("systemctl", "start", "flowpacer.service", timeout=300)
        record("start_s", round(time.monotonic() - t, 1))
        st = status()
        check(st is not None, "no status right after systemctl start returned")
        longf = flow_on(st, PORT_LONG)
        record("after_start", {"backend": st["backend"], "long_flow": longf, "root": root_qdisc(tb)})
        check(st["backend"] == "psp" and root_qdisc(tb) == "psp", "the backend is not psp")
        check(len(longf) == 1 and longf[0]["rate_bit"] == RATE1,
              "READY=1 came before the existing flow was shaped")
        base = kernel_classes(tb) - owned(st)   # the qdisc's own classes
        classid = longf[0]["classid"]
        props = show("MainPID", "NRestarts", "ActiveState", "SubState", "Type", "WatchdogUSec")
        record("unit", props)
        check(props["ActiveState"] == "active" and props["SubState"] == "running", "not running")

        got, want = measure(tb, PORT_MEASURE)["goodput_bps"], RATE1 / 8 * WIRE
        record("measured_1", {"goodput_bytes_per_s": round(got), "want": round(want)})
        check(abs(got / want - 1) < 0.05, f"a new flow got {got:.0f} B/s, its rule {want:.0f}")

        # ---- reload with a changed rate
        write_rules(tb, RATE2)
        sh("systemctl", "reload", "flowpacer.service")
        wait_for(lambda: (flow_on(status(), PORT_LONG) or [{}])[0].get("rate_bit") == RATE2, 60, 0.5,
                 "the long flow re-rated by the reload")
        got, want = measure(tb, PORT_MEASURE)["goodput_bps"], RATE2 / 8 * WIRE
        record("measured_2", {"goodput_bytes_per_s": round(got), "want": round(want)})
        check(abs(got / want - 1) < 0.05, f"after the reload a new flow got {got:.0f} B/s, not {want:.0f}")
        check(show("ActiveState")["ActiveState"] == "active", "not active after the reload")

        # ---- kill -9: Restart= brings it back, the live flow is adopted, nothing leaked
        pid = int(show("MainPID")["MainPID"])
        os.kill(pid, 9)
        t = time.monotonic()
        wait_for(lambda: (s := show("MainPID", "ActiveState", "NRestarts"))["ActiveState"] == "active"
                 and s["MainPID"] not in ("0", str(pid)) and s["NRestarts"] == "1", 180, 0.5,
                 "the restart after kill -9")
        wait_for(lambda: flow_on(status(), PORT_LONG), 60, 0.5, "the long flow after the restart")
        st = status()
        record("after_kill9", {"restart_s": round(time.monotonic() - t, 1),
                               "long_flow": flow_on(st, PORT_LONG),
                               "kernel_classes": sorted(kernel_classes(tb))})
        check(flow_on(st, PORT_LONG)[0]["classid"] == classid, "the live flow was not adopted")
        leaked = kernel_classes(tb) - base - owned(st)
        check(not leaked, f"classes leaked by the kill: {sorted(leaked)}")

        # ---- a hung stage: the main loop's thread stopped; the watchdog restarts the service
        pid = int(show("MainPID")["MainPID"])
        t = time.monotonic()
        tracer = hang_thread(pid, 240)          # the main thread's tid is the pid
        wait_for(lambda: (s := show("MainPID", "ActiveState", "NRestarts"))["NRestarts"] == "2"
                 and s["ActiveState"] == "active" and s["MainPID"] not in ("0", str(pid)), 300, 1.0,
                 "the watchdog's restart of the hung daemon")
        tracer.wait(timeout=60)
        wait_for(lambda: flow_on(status(), PORT_LONG), 60, 0.5, "the long flow after the watchdog")
        log = journal()
        record("watchdog", {"restart_s": round(time.monotonic() - t, 1),
                            "journal": [line for line in log.splitlines() if "atchdog" in line][-5:]})
        check(re.search(r"[Ww]atchdog timeout", log), "systemd logged no watchdog timeout")
        st = status()
        check(flow_on(st, PORT_LONG)[0]["classid"] == classid, "the live flow was not adopted")
        leaked = kernel_classes(tb) - base - owned(st)
        check(not leaked, f"classes leaked after the watchdog: {sorted(leaked)}")

        # ---- stop: everything removed
        sh("systemctl", "stop", "flowpacer.service", timeout=120)
        record("after_stop", {"root": root_qdisc(tb), "classes": sorted(kernel_classes(tb)),
                              "state": show("ActiveState", "Result")})
        check(root_qdisc(tb) != "psp" and not kernel_classes(tb), "the stop left qdiscs or classes")
        check(not Path("/run/flowpacer").exists(), "/run/flowpacer is left")

    p = sh("systemd-analyze", "security", "--no-pager", "flowpacer.service", check_rc=False)
    m = re.search(r"Overall exposure level for flowpacer\.service: (\S+) (\S+)", p.stdout)
    record("security", {"score": m.group(1) if m else None, "rating": m.group(2) if m else None})
    record("total_s", round(time.monotonic() - t0, 1))
    record("ok", True)


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except (Failed, TimeoutError, subprocess.TimeoutExpired) as e:
        record("failed", str(e))
        try:
            record("journal_tail", journal().splitlines()[-30:])
        except Failed:
            pass
        sys.exit(1)
