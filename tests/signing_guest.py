"""Inside the test VM booted with ``module.sig_enforce=1``: the kernel refuses the unsigned psp
module, and the daemon says so (issue 27.5). Run by tests/test_vm_signing.py:

    python tests/signing_guest.py            (FLOWPACER_PSP_KO: the module built for this kernel)

Steps: the kernel enforces signatures; the module, installed where modprobe finds it
(/lib/modules/$(uname -r)/updates, in the guest's tmpfs overlay) is unsigned and refused
("Key was rejected by service"); ``backend: auto`` starts on htb and gives the kernel's reason
in one line in its log, in ``status`` (JSON and text) and in the metric
``flowpacer_backend_fallback``; it shapes an IPv4 (v4-mapped on a dual-stack listener) and an
IPv6 flow to their rules at the same time; ``backend: psp`` fails at start with that line and
the pointer to the docs, without a traceback. Each step appends what it saw to
$FLOWPACER_VM_OUT/signing_guest.json; the first failed check ends the run (exit 1).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.daemon import Daemon, DaemonExited  # noqa: E402
from harness.testbed import (FLOWPACER, Testbed, client_argv, in_netns, server_argv,  # noqa: E402
                             wait_for)
from harness.traffic import WIRE, WIRE6  # noqa: E402

OUT = Path(os.environ.get("FLOWPACER_VM_OUT", "/tmp")) / "signing_guest.json"
RESULTS: dict = {"steps": []}
SERVER = "fp-sig-srv"
RATE4, RATE6 = 3_000_000, 5_000_000        # bit/s of the two rules
METRICS = "127.0.0.1:9719"
RULES = f"""
    interface: IFACE
    backend: BACKEND
    link_rate: 1gbit
    rules:
      - name: four
        match: {{process: {SERVER}, direction: inbound, local_port: 9101}}
        rate: 3mbit
      - name: six
        match: {{process: {SERVER}, direction: inbound, local_port: 9102}}
        rate: 5mbit
"""
KERNEL_WORDS = "Key was rejected by service"


class Failed(Exception):
    pass


def step(name: str, **seen) -> None:
    RESULTS["steps"].append({"step": name, **seen})
    OUT.write_text(json.dumps(RESULTS, indent=1))


def check(ok: bool, why: str) -> None:
    if not ok:
        raise Failed(why)


def sh(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def install_unsigned_module() -> str:
    """The module where DKMS puts it, with the depmod indexes the host made for it (a depmod
    over the whole modules tree takes minutes over 9p under TCG)."""
    ko = Path(os.environ["FLOWPACER_PSP_KO"])
    index = Path(os.environ["FLOWPACER_MODULE_INDEX"])
    rel = os.uname().release
    moddir = Path(f"/lib/modules/{rel}")
    dest = moddir / "updates/dkms/sch_psp.ko"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ko, dest)
    for f in index.glob("modules.*"):
        shutil.copy(f, moddir / f.name)
    info = sh(["modinfo", "sch_psp"]).stdout
    check(str(dest) in info and not re.search(r"^signer:", info, re.M),
          f"modinfo sch_psp should show the unsigned file:\n{info}")
    return str(dest)


def one_line_with_the_kernels_words(text: str, where: str) -> str:
    lines = [ln for ln in text.splitlines() if KERNEL_WORDS in ln]
    check(bool(lines), f"{where}: no line with {KERNEL_WORDS!r}:\n{text[-3000:]}")
    line = lines[0]
    check("docs/packaging.md" in line and "unsigned" in line and "module.sig_enforce=1" in line,
          f"{where}: the line lacks the policy, the signer or the docs: {line}")
    return line


def metrics(tb) -> str:
    with in_netns(tb.server_ns):
        with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=30) as r:
            return r.read().decode()


def fetch(tb, host: str, port: int, seconds: float, warmup: float):
    return tb.popen(tb.client_ns, client_argv(host, port, seconds, warmup=warmup),
                    stdout=subprocess.PIPE, text=True)


def auto_falls_back_and_shapes(tb, work: Path) -> None:
    tb.popen(tb.server_ns, server_argv([9101, 9102], SERVER, v6=True))
    tb.wait_listening(9102)
    (work / "auto").mkdir(parents=True, exist_ok=True)
    d = Daemon(tb, work / "auto", RULES, "--no-tracer", "--rescan", "0.5",
               "--metrics", METRICS, backend="auto")
    d.start()
    try:
        st = d.status_cli()
        check(st["backend"] == "htb", f"backend {st['backend']}, not htb: {st['backend_reason']}")
        check(st["backend_wanted"] == "auto" and KERNEL_WORDS in st["backend_fallback"],
              f"status: {st}")
        status_line = one_line_with_the_kernels_words(st["backend_reason"], "status")
        text = sh([*FLOWPACER, "status", "--socket", d.sock]).stdout
        check(re.search(r"^backend: +htb \(auto: psp unavailable \(the kernel refused sch_psp: "
                        + KERNEL_WORDS, text, re.M) is not None, f"flowpacer status:\n{text}")
        check(re.search(r"^module: +sch_psp: unsigned, not loaded; the kernel requires signed "
                        r"modules \(module\.sig_enforce=1\): it will not load", text, re.M)
              is not None, f"flowpacer status, module line:\n{text}")
        log_line = one_line_with_the_kernels_words(d.log_text(), "daemon log")
        check("Traceback" not in d.log_text(), "traceback in the daemon log")
        m = metrics(tb)
        fam = [ln for ln in m.splitlines() if ln.startswith("flowpacer_backend_fallback{")]
        check(len(fam) == 1 and 'wanted="psp"' in fam[0] and 'used="htb"' in fam[0]
              and KERNEL_WORDS in fam[0] and fam[0].endswith(" 1.0"), f"metric: {fam}")
        step("auto falls back to htb", status=status_line, log=log_line, metric=fam[0],
             status_text=text)
        # both families in one batch: IPv4 to the dual-stack listener (v4-mapped), IPv6
        c4 = fetch(tb, str(tb.server_v4), 9101, 8, 2.5)
        c6 = fetch(tb, str(tb.server_v6), 9102, 8, 2.5)
        flows = wait_for(lambda: (lambda f: f if len(f) == 2 else None)(d.flows()), 30, 0.1,
                         "both shaped flows")
        fams = sorted(f["family"] for f in flows)
        res = {}
        for port, c in ((9101, c4), (9102, c6)):
            out, _ = c.communicate(timeout=120)
            check(c.returncode == 0, f"client of port {port} exited {c.returncode}")
            res[port] = json.loads(out.strip().splitlines()[-1])["goodput_bps"]
        got = {}
        for port, bit, wire in ((9101, RATE4, WIRE), (9102, RATE6, WIRE6)):
            want = bit / 8 * wire
            got[port] = round(100 * res[port] / want, 2)
            check(abs(res[port] / want - 1) <= 0.05,
                  f"port {port}: {res[port] * 8e-6:.3f} Mbit/s, rule {bit / 1e6:g} Mbit "
                  f"({got[port]} % of rate x payload/frame)")
        step("htb shapes IPv4 and IPv6 flows", families=fams,
             percent_of_rate_x_payload=got,
             mbit={p: round(v * 8e-6, 3) for p, v in res.items()})
    finally:
        rc = d.stop()
    check(rc == 0, f"the auto daemon exited {rc}:\n{d.log_text()[-2000:]}")


def psp_fails_at_start(tb, work: Path) -> None:
    (work / "psp").mkdir(parents=True, exist_ok=True)
    d = Daemon(tb, work / "psp", RULES, "--no-tracer", "--no-metrics", backend="psp")
    try:
        d.start(timeout=90)
        started = True
    except DaemonExited:
        started = False
    rc = d.stop()
    log = d.log_text()
    check(not started and rc not in (0, None), f"backend psp started (exit {rc}):\n{log[-2000:]}")
    check("Traceback" not in log, f"traceback:\n{log[-3000:]}")
    line = one_line_with_the_kernels_words(log, "backend psp's error")
    step("backend psp fails at start", exit=rc, line=line)


def main() -> int:
    try:
        enforce = Path("/sys/module/module/parameters/sig_enforce").read_text().strip()
        check(enforce == "Y", f"module.sig_enforce is {enforce!r}: the VM must boot with it")
        dest = install_unsigned_module()
        p = sh(["insmod", dest])
        check(p.returncode != 0 and KERNEL_WORDS in p.stderr,
              f"insmod of the unsigned module: exit {p.returncode}: {p.stderr}")
        step("the kernel refuses the unsigned module", insmod=p.stderr.strip())
        # the daemons' files in the guest's /tmp (a Unix socket cannot live on the 9p share);
        # their logs are copied to the share afterwards
        work = Path(tempfile.mkdtemp(prefix="fp-sig-"))
        try:
            with Testbed() as tb:
                auto_falls_back_and_shapes(tb, work)
                psp_fails_at_start(tb, work)
        finally:
            for log in work.glob("*/daemon.log"):
                shutil.copy(log, OUT.parent / f"daemon-{log.parent.name}.log")
        check(not Path("/sys/module/sch_psp").exists(), "sch_psp got loaded after all")
    except (Failed, AssertionError) as e:
        RESULTS["failed"] = str(e)
        OUT.write_text(json.dumps(RESULTS, indent=1))
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    RESULTS["ok"] = True
    OUT.write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
