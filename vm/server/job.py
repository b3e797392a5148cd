#!/usr/bin/python3
"""The Debian 13 server VM's job (harness/servervm.py boots it; tests/test_server_vm.py checks
its result.json). Runs as root under systemd in a trixie guest with no network but a veth pair
to a client namespace; the root's own python3 and standard library only.

As an admin would: apt-get install the two .debs, write the rules, systemctl enable --now,
nginx serving IPv4 and IPv6 clients shaped with psp, systemctl reload after a rules edit (its
rate in tc's byte unit, which the daemon warns about: the warning read back from journald at
its syslog priority), a long download across systemctl restart and across an upgrade of the
package (a .deb with a bumped version), across a kill -9 and a hung main loop (systemd's
watchdog) that systemd restarts, each time with the live flows' classes adopted and none leaked;
systemctl stop leaves nothing. The receiver's bytes are
read from its interface counter every 20 ms; every phase's peak over 100 ms windows goes into
result.json.

sch_psp is not compiled here (DKMS under TCG took 4.5-5.5 min): the host built it with DKMS for
this kernel in the same root (harness/servervm.py: dkms_tarball), and the binaries-only tarball
of ``dkms mktarball`` is put where the package's postinst (dkms's common.postinst) looks for one,
/usr/share/sch_psp-dkms/sch_psp-VERSION.dkms.tar.gz: apt's configure step then runs ``dkms
ldtarball`` and ``dkms install`` instead of ``dkms build``. The headers stay installed: the
postinst still would build for a kernel the tarball lacks.
"""
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

OUT = "/fp-out"
SRV, CLI, NS = "fps0", "fpc0", "fpcli"
V4S, V4C, V6S, V6C = "10.99.0.1", "10.99.0.2", "fd99::1", "fd99::2"
# the rule's rate per download. Low: the guest shares make test's CPU with the timed lane's
# real-clock guest and may get a quarter of it; it then delivered 6 of 20 Mbit/s per download,
# and a stalled vCPU's paced pair caught up in bursts of 2.2 times its rate in 100 ms windows
RATE_MBIT = 4
WINDOW_S = 0.5          # the restart/upgrade checks' window: a stall's catch-up averages out in
                        # it, a gap (seconds unshaped while a daemon is down) does not
CONTROL = "/run/flowpacer/control.sock"
BASE_CLASSES = set()   # the qdisc's own classes (link, default): read before any flow
result = {"steps": [], "phases": {}}
T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}] {msg}", flush=True)


def sh(cmd, check=True, timeout=900):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{cmd}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def step(name, cmd, **kw):
    t = time.monotonic()
    p = sh(cmd, **kw)
    result["steps"].append({"name": name, "s": round(time.monotonic() - t, 2),
                            "rc": p.returncode})
    log(f"{name}: {time.monotonic() - t:.1f} s")
    return p


def wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def cli_status():
    """``flowpacer status --json``, as an admin asks."""
    p = sh("flowpacer status --json", check=False, timeout=60)
    if p.returncode != 0:
        return None
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None


def status():
    """The same answer for the job's polls, asked on the control socket directly (one JSON
    request per connection, surfaces/control.py): a poll then costs no Python start and imports,
    seconds each under TCG, so that a wait ends when its condition holds."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(CONTROL)
            s.sendall(b'{"cmd": "status"}\n')
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
        st = json.loads(data)
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) and "error" not in st else None


class Sampler(threading.Thread):
    """The client interface's received bytes, read in the client namespace every 20 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples = []
        self.stop = threading.Event()

    def run(self):
        fd = os.open(f"/run/netns/{NS}", os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)       # this thread only
        while not self.stop.is_set():
            with open("/proc/thread-self/net/dev") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name.strip() == CLI:
                        self.samples.append((time.monotonic(), int(rest.split()[0])))
            self.stop.wait(0.02)

    def peak(self, t_from, t_to, window=0.1):
        s = [x for x in self.samples if t_from <= x[0] <= t_to]
        best, j = 0.0, 0
        for i, (ti, bi) in enumerate(s):
            j = max(j, i + 1)
            while j < len(s) and s[j][0] - ti < window:
                j += 1
            if j >= len(s):
                break
            best = max(best, (s[j][1] - bi) * 8 / (s[j][0] - ti))
        return best


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)
    wait(lambda: (st := status()) is not None and not st["flows"], 60, "ended flows removed")


def rules(rate_mbit, byte_unit=False):
    """The rules file: nginx's downloads at ``rate_mbit``; ``byte_unit``: written in tc's byte
    unit (20 Mbit/s as "2500kbps"), which the loader accepts with a warning (issue 28 item 2)."""
    rate = f"{rate_mbit * 125}kbps" if byte_unit else f"{rate_mbit}mbit"
    with open("/etc/flowpacer/rules.yaml", "w") as f:
        f.write(f"""interface: {SRV}
backend: psp
link_rate: 1gbit
rules:
  - name: web
    match: {{process: nginx, direction: inbound, local_port: 80}}
    rate: {rate}
""")
    os.chmod("/etc/flowpacer/rules.yaml", 0o644)


def downloads(seconds):
    """Two curl downloads from nginx (IPv4 and IPv6) in the client namespace."""
    procs = []
    for host in (V4S, f"[{V6S}]"):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", NS, "curl", "-s", "-o", "/dev/null", "--max-time", str(seconds),
             "-w", "%{size_download} %{speed_download}\n", f"http://{host}/big"],
            stdout=subprocess.PIPE, text=True))
    return procs


def received():
    """{remote port: bytes received} of the client's connections to nginx (ss -ti: the
    receiver's own per-flow count)."""
    out, port = {}, None
    for line in sh(f"ip netns exec {NS} ss -tinH state established '( dport = :80 )'").stdout.splitlines():
        toks = line.split()
        if line and not line[0].isspace():
            # Recv-Q Send-Q LOCAL PEER (one state asked: no State column): the client's port
            peer = next((i for i, t in enumerate(toks) if i > 0 and t.endswith(":80")), None)
            port = toks[peer - 1].rsplit(":", 1)[1] if peer else None
        for tok in line.split():
            if tok.startswith("bytes_received:") and port:
                out[port] = int(tok.split(":")[1])
    return out


def per_flow_rates(seconds=4.0):
    """bit/s of each download over ``seconds``, from the receiver's counters."""
    a, t1 = received(), time.monotonic()
    wait(lambda: time.monotonic() > t1 + seconds, seconds + 5, "a measured interval")
    b, t2 = received(), time.monotonic()
    return sorted(round((b[k] - a[k]) * 8 / (t2 - t1)) for k in a if k in b)


def shaped_flows(n, timeout=60):
    return wait(lambda: (st := status()) and len(st.get("flows", [])) >= n and st, timeout,
                f"{n} flows shaped")


def across(name, action, sampler, rate_mbit, before_s=3.0, after_s=4.0):
    """Two downloads, ``action`` while they run, the peak 100 ms rate before and across; after
    it, the flows' classes: the same class ids as before (adopted by the next process, not
    made again) and no class in the kernel that is neither the qdisc's own nor a flow's."""
    procs = downloads(900)
    try:
        st = shaped_flows(2)
        before = owned(st)
        t_shaped = time.monotonic()
        wait(lambda: time.monotonic() > t_shaped + before_s, before_s + 5, "shaped downloads")
        t_act = time.monotonic()
        action()
        t_done = time.monotonic()
        wait(lambda: time.monotonic() > t_done + after_s, after_s + 5, "downloads after")
        t_end = time.monotonic()
        st = shaped_flows(2)
        after = owned(st)
        leaked = kernel_classes() - BASE_CLASSES - after
    except BaseException as e:
        # the downloads go, and this error is the one reported (stop()'s wait for the flows'
        # removal would time out when the action left no daemon, and hide it)
        for p in procs:
            p.kill()
        raise RuntimeError(f"{name}: {e}") from e
    stop(procs)
    ph = {"limit_mbit": 2 * rate_mbit,
          "peak_before_mbit": round(sampler.peak(t_shaped + 0.5, t_act, WINDOW_S) / 1e6, 2),
          "peak_across_mbit": round(sampler.peak(t_act - 0.2, t_end, WINDOW_S) / 1e6, 2),
          "peak_across_100ms_mbit": round(sampler.peak(t_act - 0.2, t_end) / 1e6, 2),
          "action_s": round(t_done - t_act, 2),
          "classes_before": sorted(before), "classes_after": sorted(after),
          "classes_leaked": sorted(leaked)}
    result["phases"][name] = ph
    log(f"{name}: {ph}")


def show(*props):
    """``systemctl show`` of the unit: {property: value}."""
    out = sh(f"systemctl show flowpacer.service -p {','.join(props)}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def kernel_classes():
    """The class ids on the server's interface, as tc prints them."""
    return set(re.findall(r"^class \S+ (\S+)", sh(f"tc class show dev {SRV}").stdout, re.M))


def owned(st):
    """The class ids status gives the flows (and their groups)."""
    return ({f["classid"] for f in st.get("flows", []) if f.get("classid")}
            | {g["classid"] for g in st.get("groups", []) if g.get("classid")})


def restarted(old_pid, restarts):
    """Once systemd has the unit active again under a new main process, ``restarts`` + 1."""
    s = show("MainPID", "ActiveState", "NRestarts")
    return (s.get("ActiveState") == "active" and s.get("MainPID") not in ("0", str(old_pid))
            and s.get("NRestarts") == str(restarts + 1) and s)


def kill_9():
    """SIGKILL to the daemon: Restart=on-failure starts the next one, which adopts the classes
    the dead one left (nothing removes them: no ExecStopPost cleanup while a restart is due)."""
    s = show("MainPID", "NRestarts")
    pid, n = int(s["MainPID"]), int(s["NRestarts"])
    os.kill(pid, signal.SIGKILL)
    got = wait(lambda: restarted(pid, n), 300, "the restart after kill -9")
    result["kill_9"] = {"old_pid": pid, "after": got}


# Run as a separate process: stops thread TID only (PTRACE_SEIZE + PTRACE_INTERRUPT) and stays its
# tracer until the process is a zombie or LIMIT seconds pass, then exits, which detaches it (the
# parent, systemd, hears of the death once the tracer is gone).
HANG = r"""
import ctypes, sys, time
tid, limit = int(sys.argv[1]), float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for req in (0x4206, 0x4207):          # PTRACE_SEIZE, PTRACE_INTERRUPT
    if libc.ptrace(req, tid, None, None) != 0:
        sys.exit(f"ptrace {req:#x} of {tid}: errno {ctypes.get_errno()}")
print("stopped", flush=True)
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        state = open(f"/proc/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        break
    if state in ("Z", "X"):
        break
    time.sleep(0.2)
"""


def hung_main_loop():
    """The daemon's main thread stopped (its other threads run on): it stops sending
    WATCHDOG=1, systemd kills it after WatchdogSec and starts the next one."""
    s = show("MainPID", "NRestarts")
    pid, n = int(s["MainPID"]), int(s["NRestarts"])
    tracer = subprocess.Popen([sys.executable, "-c", HANG, str(pid), "400"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = tracer.stdout.readline().strip()
    if line != "stopped":
        tracer.wait(timeout=30)
        raise RuntimeError(f"could not stop thread {pid}: {tracer.stderr.read().strip()}")
    got = wait(lambda: restarted(pid, n), 400, "the watchdog's restart of the hung daemon")
    tracer.wait(timeout=60)
    lines = sh("journalctl -u flowpacer -b --no-pager -o cat").stdout.splitlines()
    result["watchdog"] = {"old_pid": pid, "after": got,
                          "journal": [ln for ln in lines if "atchdog" in ln][-5:]}


def unshaped(sampler, seconds=4):
    """The mean rate two unshaped downloads reach (before flowpacer is installed): what a gap
    in the shaping would show, recorded for the check that the instrument can see one."""
    t0 = time.monotonic()
    procs = downloads(seconds)
    for p in procs:
        p.communicate(timeout=seconds + 60)
    s = [x for x in sampler.samples if x[0] >= t0]
    mean = (s[-1][1] - s[0][1]) * 8 / (s[-1][0] - s[0][0]) / 1e6 if len(s) > 1 else 0.0
    result["unshaped"] = {"mean_mbit": round(mean, 2),
                          "peak_mbit": round(sampler.peak(t0, time.monotonic()) / 1e6, 2),
                          f"peak_{WINDOW_S}s_mbit": round(sampler.peak(t0, time.monotonic(),
                                                                     WINDOW_S) / 1e6, 2)}
    log(f"unshaped: {result['unshaped']}")


def journal(*args):
    """flowpacer's journal entries (``journalctl -o json``) since this boot."""
    out = sh("journalctl -u flowpacer -b --no-pager -o json " + " ".join(args), timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def journal_priorities(reload_rate):
    """What journald stored for the daemon's records around the reload (issue 28 item 5): the
    loader's warning about the byte unit at PRIORITY 4 with its structured fields, the reload's
    info line at PRIORITY 6, and which of them ``journalctl -p warning`` shows."""
    unit = f"'{reload_rate}'"

    def entries():
        full = journal()
        warn = [e for e in full if unit in str(e.get("MESSAGE", "")) and "kbps" in str(e.get("MESSAGE", ""))]
        info = [e for e in full if str(e.get("MESSAGE", "")).startswith("reloaded ")]
        return (full, warn, info) if warn and info else None

    full, warn, info = wait(entries, 60, "the reload's warning and info line in the journal")
    keep = ("MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "LOGGER", "CODE_FILE", "CODE_LINE",
            "CODE_FUNC", "FLOWPACER_RULES_FILE", "FLOWPACER_LINE", "_TRANSPORT", "_SYSTEMD_UNIT")
    p_warning = journal("-p", "warning")
    return {"warning": {k: warn[-1].get(k) for k in keep},
            "info": {k: info[-1].get(k) for k in keep},
            "p_warning_messages": [str(e.get("MESSAGE", ""))[:300] for e in p_warning],
            "p_warning_priorities": sorted({str(e.get("PRIORITY")) for e in p_warning}),
            "priorities_all": sorted({str(e.get("PRIORITY")) for e in full}),
            "entries_all": len(full)}


def module_facts():
    """The sch_psp that modprobe finds: ``modinfo``'s filename, vermagic, srcversion and signer,
    and the file's sha256."""
    info = {}
    for line in sh("modinfo sch_psp", check=False).stdout.splitlines():
        key, _, value = line.partition(":")
        if key in ("filename", "vermagic", "srcversion", "signer"):
            info[key] = value.strip()
    try:
        with open(info.get("filename", ""), "rb") as f:
            info["sha256"] = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        info["sha256"] = None
    return info


def loaded_srcversion():
    """The srcversion of the sch_psp the kernel has loaded (None: not loaded)."""
    try:
        with open("/sys/module/sch_psp/srcversion") as f:
            return f.read().strip()
    except OSError:
        return None


def leftovers():
    q = sh(f"tc qdisc show dev {SRV}").stdout
    links = sh("ip -o link show").stdout
    return {"qdisc": q.strip(), "f1f0": "f1f0:" in q, "ifb": "fpi-" in links}


def warm_up_connection_hashes():
    """One IPv4 and one IPv6 TCP connection over loopback, one after the other, before any
    concurrent traffic. The first established-socket lookup of each family seeds its hash
    secret (net_get_random_once) and then patches that code's jump labels from a work item.
    Under TCG with two vCPUs, a patch made while the other vCPU ran the same lookup in softirq
    left it a stale int3: rehearsal ci26's guest panicked in inet6_ehashfn 1.5 s into the job,
    at the first IPv4 and IPv6 curl. Done here, the patching happens while nothing else runs."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family, socket.SOCK_STREAM) as srv:
            srv.bind((host, 0))
            srv.listen(1)
            with socket.create_connection(srv.getsockname()[:2], timeout=10):
                srv.accept()[0].close()
    time.sleep(1)      # the work item that patches the jump labels runs right after (no marker)


def main():
    os.environ["DEBIAN_FRONTEND"] = "noninteractive"      # no terminal under systemd
    os.makedirs("/run/netns", exist_ok=True)
    with open("/proc/uptime") as f:
        result["uptime_at_job_s"] = float(f.read().split()[0])     # the boot, on the guest's clock
    step("kernel", "uname -r")
    result["kernel"] = sh("uname -r").stdout.strip()
    result["systemd"] = sh("systemctl --version").stdout.splitlines()[0]
    result["os"] = sh(". /etc/os-release; echo $PRETTY_NAME").stdout.strip()
    result["python"] = sh("python3 --version").stdout.strip()
    step("veth", f"""ip netns add {NS}
ip link add {SRV} type veth peer name {CLI} netns {NS}
ip addr add {V4S}/24 dev {SRV}; ip addr add {V6S}/64 dev {SRV} nodad; ip link set {SRV} up
ip -n {NS} addr add {V4C}/24 dev {CLI}; ip -n {NS} addr add {V6C}/64 dev {CLI} nodad
ip -n {NS} link set {CLI} up; ip -n {NS} link set lo up""")
    warm_up_connection_hashes()
    step("content", "truncate -s 8G /var/www/html/big")
    step("nginx", "systemctl is-active nginx || systemctl start nginx")
    wait(lambda: sh(f"ip netns exec {NS} curl -s -o /dev/null -r 0-0 http://{V4S}/big && "
                    f"ip netns exec {NS} curl -s -o /dev/null -r 0-0 http://[{V6S}]/big",
                    check=False).returncode == 0, 60, "nginx answering on IPv4 and IPv6")
    # sch_psp as built by DKMS on the host for this kernel: where the package's postinst loads
    # a binaries-only tarball from instead of building (module docstring)
    sampler = Sampler()
    sampler.start()
    unshaped(sampler)
    tarballs = glob.glob("/fp-out/sch_psp-*.dkms.tar.gz")
    if len(tarballs) != 1:
        raise RuntimeError(f"want one DKMS tarball in /fp-out, found {tarballs}")
    os.makedirs("/usr/share/sch_psp-dkms", exist_ok=True)
    shutil.copy(tarballs[0], "/usr/share/sch_psp-dkms/")
    result["headers_installed"] = os.path.exists(f"/lib/modules/{result['kernel']}/build/include")
    # the guest has no network: every dependency is in the root already, and
    # the recommendations it lacks (python3-bpfcc) are left out
    apt = "apt-get install -y --no-install-recommends"
    p = step("apt install", f"{apt} /fp-out/flowpacer_0.1.0_all.deb /fp-out/sch-psp-dkms_0.1.0_all.deb",
             timeout=1800)
    result["dkms"] = sh("dkms status").stdout.strip()
    result["apt_tail"] = p.stdout[-1500:]
    # what DKMS's postinst did, in its own words
    result["apt_dkms"] = [line for line in p.stdout.splitlines()
                          if re.search(r"(?i)dkms|sch_psp|building|loading|installing|module", line)][-25:]
    result["module_file"] = module_facts()
    rules(RATE_MBIT)
    step("rules check", "flowpacer rules check /etc/flowpacer/rules.yaml")
    step("enable --now", "systemctl enable --now flowpacer", timeout=600)
    st = wait(cli_status, 300, "flowpacer status")
    BASE_CLASSES.update(kernel_classes() - owned(st))
    result["base_classes"] = sorted(BASE_CLASSES)
    result["backend"] = st.get("backend")
    result["module_loaded_srcversion"] = loaded_srcversion()
    result["qdisc_running"] = sh(f"tc qdisc show dev {SRV}").stdout.strip()
    result["enabled"] = sh("systemctl is-enabled flowpacer").stdout.strip()
    # shaped at the rule's rate, IPv4 and IPv6
    t_start = time.monotonic()
    procs = downloads(300)
    st = shaped_flows(2)
    t_shaped = time.monotonic()
    result["flows"] = [{k: f.get(k) for k in ("family", "remote", "rate_bit", "rule", "classid")}
                       for f in st["flows"]]
    # sock_diag polling (no bcc here): a new flow runs unshaped until the next pass finds it
    result["peak_before_shaped_mbit"] = round(sampler.peak(t_start, t_shaped) / 1e6, 2)
    wait(lambda: time.monotonic() > t_shaped + 1, 5, "shaped for a second")
    result["received_bps"] = per_flow_rates()
    stop(procs)
    # reload after a rules edit, the new rate in tc's byte unit (a warning in the log)
    rules(RATE_MBIT // 2, byte_unit=True)
    step("reload", "systemctl reload flowpacer")
    result["journal"] = journal_priorities(f"{RATE_MBIT // 2 * 125}kbps")
    procs = downloads(300)
    st = shaped_flows(2)
    result["rates_after_reload_bit"] = sorted({f.get("rate_bit") for f in st["flows"]})
    t_shaped = time.monotonic()
    wait(lambda: time.monotonic() > t_shaped + 1, 5, "shaped for a second")
    result["received_bps_after_reload"] = per_flow_rates()
    stop(procs)
    rules(RATE_MBIT)
    step("reload back", "systemctl reload flowpacer")
    # a long download across systemctl restart
    across("restart", lambda: step("restart", "systemctl restart flowpacer", timeout=600),
           sampler, RATE_MBIT)
    # a crash (kill -9) and a hung main loop (the watchdog) while they run: restarted by
    # systemd, the live flows adopted
    across("kill -9", kill_9, sampler, RATE_MBIT)
    across("watchdog", hung_main_loop, sampler, RATE_MBIT)
    # and across an upgrade of the package
    across("upgrade", lambda: step("upgrade", f"{apt} /fp-out/flowpacer_0.1.0+fpupgrade1_all.deb",
                                   timeout=900),
           sampler, RATE_MBIT)
    result["version_after_upgrade"] = sh("dpkg-query -W -f '${Version}' flowpacer").stdout
    result["active_after_upgrade"] = sh("systemctl is-active flowpacer", check=False).stdout.strip()
    result["before_stop"] = leftovers()
    step("stop", "systemctl stop flowpacer", timeout=300)
    result["after_stop"] = leftovers()
    result["journal_stop"] = sh("journalctl -u flowpacer --no-pager -n 15 -o cat").stdout[-2500:]
    sampler.stop.set()
    result["ok"] = True


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        result["ok"] = False
        result["error"] = str(e)[-4000:]
        log(f"FAILED: {e}")
        try:
            result["journal_tail"] = sh("journalctl -u flowpacer --no-pager -n 60 -o cat",
                                   check=False).stdout[-4000:]
        except Exception:
            pass
    result["total_s"] = round(time.monotonic() - T0, 1)
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    raise SystemExit(0 if result.get("ok") else 1)
