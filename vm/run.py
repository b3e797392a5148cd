#!/usr/bin/env python3
"""Run one command as root inside the flowpacer test VM (qemu TCG, a Debian kernel).

    python3 vm/run.py [--timeout S] [--insmod FILE.ko] [--env K=V] [--clock virtual] -- COMMAND [ARG...]

The guest sees the host's root read-only over 9p under a tmpfs overlay (so it has the
host's python, venv, tc and iperf3 and the repo at the same path), runs COMMAND in the same
working directory with ``FLOWPACER_IN_VM=1``, and powers off. The command's output is
streamed while it runs; the exit status is the command's. ``FLOWPACER_VM_OUT`` names a
directory that is shared with the host (the same path on both sides) for result files.

As a library: ``run(cmd, ...) -> VMResult`` (raises ``VMError`` when the guest cannot boot
or does not finish; the message carries the console log).

Two clocks (``clock=`` / ``--clock`` / ``FLOWPACER_VM_CLOCK``, default real):

* ``Clock.REAL``: plain TCG, two vCPUs; guest time is the host's, so a busy host makes the
  guest's timers fire late.
* ``Clock.VIRTUAL``: qemu's instruction counter drives the guest's clock (``-icount
  shift=0,sleep=off``: one guest instruction is one nanosecond, idle time is skipped), one
  vCPU (two hang at CPU bring-up in this mode). Guest time is exact and does not depend on
  the host's load: pacing measurements are repeatable. The guest's command sees
  ``FLOWPACER_VM_CLOCK=virtual``.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

if __package__:
    from . import build as vmbuild
else:  # run as a script: vm/ is sys.path[0]
    import build as vmbuild  # type: ignore[no-redef]

log = logging.getLogger(__name__)

QEMU = "qemu-system-x86_64"
DEFAULT_MEM_MB = 2048
DEFAULT_SMP = 2
# host seconds from qemu start to the job's start (FLOWPACER_VM_BOOT_TIMEOUT: a host at load 14
# took more than 90 s to boot the guest)
DEFAULT_BOOT_TIMEOUT = float(os.environ.get("FLOWPACER_VM_BOOT_TIMEOUT", "90"))
KILL_GRACE = 30.0             # host seconds past the job timeout before qemu is killed
# Kernel command line: serial console, exit qemu on panic, trust the (emulated) TSC,
# no speculative-execution mitigations (they only slow the emulation down).
# FLOWPACER_VM_APPEND adds to it (for debugging).
APPEND = "console=ttyS0 panic=-1 tsc=reliable mitigations=off init_on_alloc=0 rdinit=/init"
# Virtual time skips idle time: with every vCPU halted, qemu moves the clock straight to the next
# timer. A guest with a tickless idle may have no timer for seconds, so each wait for the host
# (a 9p read) would jump the guest's clock that far and trip the guest's own timeouts. A
# periodic tick (nohz=off: CONFIG_HZ, 250 on Debian) bounds each jump to 4 ms.
APPEND_VIRTUAL = "nohz=off"
# A byte is expensive under TCG with `-cpu max`: its ERMS/FSRM flags make the kernel's memset,
# memcpy and clear_page `rep stosb`/`rep movsb`, which TCG runs one byte an iteration (dd to
# /dev/null: 100 MB/s in the guest, 750 MB/s without them) and icount counts as one instruction a
# byte: 1 ns a byte in virtual time, where a real CPU does 16-64 bytes a cycle. And Debian's
# kernels zero every page allocation (CONFIG_INIT_ON_ALLOC_DEFAULT_ON). A sender's skb buffers
# come from a 32 KiB page-fragment cache refilled with bottom halves disabled, about once per 16
# frames of 1514 bytes: ~32 us of zeroing during which no softirq, so no qdisc watchdog, can run.
# That was the ~40 us gap every qdisc showed ~4000 times a second at 1 Gbit/s (psp 53.8 % of gaps
# within +-10 % on 6.12; without both 97.0 %; vm/README.md). The guest therefore runs without
# ERMS/FSRM (the kernel falls back to 8 bytes an iteration) and with init_on_alloc=0: the tests
# and measurements want the kernel's and the qdisc's behaviour, not the emulator's cost of a byte.
# FLOWPACER_VM_CPU overrides the CPU model (FLOWPACER_VM_CPU=max: the old one, for comparisons).
CPU = "max,-erms,-fsrm"
# A task stuck in the kernel (a deadlock: a mutex its own task holds, rtnl never released) must
# fail the run at once rather than wedge the guest until the host's time limit: the kernel's
# hung-task detector reports a task in uninterruptible sleep for longer than the timeout
# ("INFO: task ... blocked for more than N seconds") and, with hung_task_panic, panics; qemu then
# exits (panic=-1, -no-reboot) and the run fails with those lines (VMError). Debian's default
# timeout is 120 s. In virtual time the guest's clock races ahead of the host's while it waits
# for a 9p reply (a reader holding an inode lock can keep another task waiting many guest
# seconds), and idle time is skipped, so a real deadlock still reaches a longer limit within a
# few host seconds: 600 s of guest time there, 20 s in real time.
HUNG_TASK_S = {"real": 20, "virtual": 600}


def _hung_task_append(clock) -> str:
    return (f"sysctl.kernel.hung_task_timeout_secs={HUNG_TASK_S[clock.value]} "
            f"hung_task_panic=1")


def host_tsc_khz(cpuinfo: str = "/proc/cpuinfo") -> int:
    """The host's TSC rate in kHz (its ``cpu MHz``), 0 when unknown. Under plain TCG the guest's
    TSC counts the host's. The guest otherwise calibrates its TSC against the emulated PIT at
    boot, and on a loaded host (vCPU descheduled during that loop) 6.1 measured 218 and 448 MHz
    instead of 2445: with tsc=reliable its clock then ran 5-11x fast and every guest-side time
    limit fired early (``modprobe veth`` "timed out after 30 s" within a few host seconds).
    ``tsc_early_khz`` (Linux 5.8) skips that calibration."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 0
_HIDDEN_DIRS = ("/proc", "/sys", "/dev", "/run")  # fresh in the guest: host paths there are not


def _tsc_append(clock) -> str:
    khz = host_tsc_khz() if clock is Clock.REAL else 0
    return f"tsc_early_khz={khz}" if khz else ""


class Clock(enum.Enum):
    """How the guest's time runs (see the module docstring)."""
    REAL = "real"          # plain TCG, 2 vCPUs, host time
    VIRTUAL = "virtual"    # icount: 1 instruction = 1 ns, 1 vCPU, independent of the host

    @classmethod
    def parse(cls, value: Union["Clock", str, None]) -> "Clock":
        """A Clock from a Clock, its name, or None (then ``$FLOWPACER_VM_CLOCK``, else REAL)."""
        if isinstance(value, Clock):
            return value
        if value is None:
            value = os.environ.get("FLOWPACER_VM_CLOCK") or "real"
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise VMError(f"unknown VM clock {value!r}: real or virtual") from None


class VMError(Exception):
    """The VM did not run the command to the end (boot failure, crash, host timeout)."""

    def __init__(self, message: str, console: str = "", output: str = ""):
        self.console = console
        self.output = output
        super().__init__(message)

    def details(self, lines: int = 60) -> str:
        """The message with the tail of the console log (and of the output, if any)."""
        parts = [str(self)]
        if self.output.strip():
            parts.append("--- command output (tail) ---")
            parts += self.output.rstrip().splitlines()[-lines:]
        parts.append("--- console log (tail) ---")
        parts += (self.console.rstrip().splitlines()[-lines:] or ["(empty)"])
        return "\n".join(parts)


@dataclasses.dataclass
class VMResult:
    rc: int                    # the command's exit status (124: it hit the guest timeout)
    output: str                # stdout and stderr, interleaved
    dmesg: str                 # the guest's kernel log after the command
    console: str               # the serial console log (boot messages, stage markers)
    boot_s: float              # host seconds from qemu start to the command's start
    wall_s: float              # host seconds for the whole run
    timed_out: bool
    out_dir: Path              # the shared directory (FLOWPACER_VM_OUT inside the guest)
    clock: Clock = Clock.REAL
    kernel: str = ""           # the guest kernel's version

    def dmesg_problems(self) -> List[str]:
        return dmesg_problems(self.dmesg)


# Kernel log lines that mean a kernel bug: WARN/BUG/Oops, memory and refcount checkers, the
# hung-task detector ("INFO: task x:1 blocked for more than 20 seconds"), lockdep's reports
# ("possible circular locking dependency", "possible recursive locking", "inconsistent lock
# state"), a panic (not "hung_task": the command line the kernel logs has it). tests/guest/kmsg.py
# checks every guest test against the same pattern.
DMESG_BAD = re.compile(r"WARNING|BUG|Oops|general protection|KASAN|refcount_t"
                       r"|INFO: task |blocked for more than"
                       r"|possible (circular|recursive) locking|inconsistent lock state"
                       r"|Kernel panic")


def dmesg_problems(text: str) -> List[str]:
    """Kernel log lines that mean the kernel found a bug (WARN, BUG, Oops, hung task,
    lockdep, ...)."""
    return [ln for ln in text.splitlines() if DMESG_BAD.search(ln)]


def _console_problems(console: str, limit: int = 6) -> str:
    """The first kernel-bug lines of the console log, for a failed run's message."""
    bad = [ln.strip() for ln in dmesg_problems(console)]
    return "; ".join(bad[:limit]) + (f" (+{len(bad) - limit} more)" if len(bad) > limit else "")


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _qemu_cmd(art: "vmbuild.Artifacts", out: Path, mem_mb: int, smp: int,
              console: Path, clock: Clock = Clock.REAL) -> List[str]:
    if clock is Clock.VIRTUAL:
        # one vCPU thread, the guest's clock counted in instructions (1 ns each), idle skipped
        accel = ["-accel", "tcg,thread=single", "-icount", "shift=0,sleep=off"]
        smp = 1
    else:
        accel = ["-accel", "tcg"]
    return [
        QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-machine", "q35", *accel, "-cpu", os.environ.get("FLOWPACER_VM_CPU", CPU), "-m", str(mem_mb), "-smp", str(smp),
        "-kernel", str(art.vmlinux), "-initrd", str(art.initramfs),
        "-append", " ".join(filter(None, (APPEND, APPEND_VIRTUAL if clock is Clock.VIRTUAL else "",
                                          _tsc_append(clock), _hung_task_append(clock),
                                          os.environ.get("FLOWPACER_VM_APPEND", "")))),
        "-serial", f"file:{console}",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                   "multidevs=remap",
        "-virtfs", f"local,path={out},mount_tag=fpout,security_model=none",
        "-device", "virtio-rng-pci",
    ]


def run(cmd: Union[Sequence[str], str], *, cwd: Optional[str] = None, timeout: float = 600,
        env: Optional[Dict[str, str]] = None, insmod: Iterable[str] = (),
        mem_mb: int = DEFAULT_MEM_MB, smp: int = DEFAULT_SMP, out_dir: Optional[Path] = None,
        boot_timeout: float = DEFAULT_BOOT_TIMEOUT,
        on_output: Optional[Callable[[str], None]] = None,
        clock: Union[Clock, str, None] = None, kernel: Optional[str] = None) -> VMResult:
    """Boot the VM, run ``cmd`` as root in ``cwd`` (default: the current directory), power off.

    ``cmd`` is an argv list, or a string for ``/bin/sh -c``. ``env`` adds variables to the
    guest's clean environment. ``insmod`` lists module files (e.g. a freshly built
    ``flowpacer/kernel/kmod/sch_psp.ko``) loaded before the command; a failing insmod fails the run.
    ``on_output`` receives the command's output as it arrives. ``clock``: ``Clock.VIRTUAL``
    (or "virtual") runs the guest in virtual time on one vCPU (``smp`` is then 1); None takes
    ``$FLOWPACER_VM_CLOCK`` (default real). The guest's command sees ``FLOWPACER_VM_CLOCK``.
    ``kernel``: a kernel series ("6.1", "6.12", "7.3") to boot instead of
    ``$FLOWPACER_VM_KERNEL``'s.
    """
    clock = Clock.parse(clock)
    if shutil.which(QEMU) is None:
        raise VMError(f"{QEMU} is not installed (apt-get install qemu-system-x86)")
    cwd = os.path.abspath(cwd or os.getcwd())
    if any(cwd == d or cwd.startswith(d + "/") for d in _HIDDEN_DIRS):
        raise VMError(f"working directory {cwd} does not exist in the guest (fresh {cwd.split('/')[1]})")
    mods = [os.path.abspath(m) for m in insmod]
    for m in mods:
        if not os.path.isfile(m):
            raise VMError(f"insmod {m}: no such file")
        if re.search(r"\s", m):
            raise VMError(f"insmod {m}: paths with white space are not supported")
    env = dict(env or {})
    env["FLOWPACER_VM_CLOCK"] = clock.value
    for k in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise VMError(f"env: {k!r} is not a variable name")
    try:
        art = vmbuild.build(series=kernel)
    except (vmbuild.BuildError, OSError) as e:
        raise VMError(f"cannot build the VM boot files: {e}") from None

    made_out = out_dir is None
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="fpvm-"))
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    if any(str(out).startswith(d + "/") for d in _HIDDEN_DIRS):
        raise VMError(f"out_dir {out} cannot be shared at the same path in the guest")
    for name in ("ready", "rc", "done", "output.log", "dmesg.txt", "stage2-error", "insmod.log"):
        (out / name).unlink(missing_ok=True)
    (out / "job.env").write_text(
        f"FP_CWD={shlex.quote(cwd)}\nFP_TIMEOUT={int(max(1, timeout))}\n"
        f"FP_HOST_OUT={shlex.quote(str(out))}\nFP_INSMOD={shlex.quote(' '.join(mods))}\n")
    script = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    script.append(f"exec /bin/sh -c {shlex.quote(cmd)}" if isinstance(cmd, str)
                  else "exec " + shlex.join(list(cmd)))
    (out / "cmd.sh").write_text("\n".join(script) + "\n")
    console = out / "console.log"
    qemu_err = out / "qemu.stderr"

    argv = _qemu_cmd(art, out, mem_mb, smp, console, clock)
    log.debug("starting %s", shlex.join(argv))
    t0 = time.monotonic()
    with open(qemu_err, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                process_group=0)   # the lane's session: harness.lanes.UNTIMED_NICE
    boot_s = None
    pos = 0
    failure = None
    try:
        while True:
            exited = proc.poll() is not None
            now = time.monotonic() - t0
            if boot_s is None and (out / "ready").exists():
                boot_s = now
                log.info("guest ready after %.1f s", boot_s)
            if on_output is not None and (out / "output.log").exists():
                with open(out / "output.log", "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                if chunk:
                    pos += len(chunk)
                    on_output(chunk.decode(errors="replace"))
            if exited:
                break
            if boot_s is None and now > boot_timeout:
                failure = f"the guest did not start the command within {boot_timeout:.0f} s"
                break
            if boot_s is not None and now > boot_s + timeout + KILL_GRACE:
                failure = (f"the guest did not finish within {timeout + KILL_GRACE:.0f} s of its "
                           f"start (killed: wedged, or its command ignored the {timeout:.0f} s "
                           f"timeout)")
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    wall = time.monotonic() - t0
    cons = _read(console)
    output = _read(out / "output.log")
    rc_text = _read(out / "rc").strip()
    if failure is None and not rc_text:
        why = _read(out / "stage2-error").strip() or (
            "the guest stopped before the command started" if boot_s is None
            else "the guest stopped before the command finished")
        qerr = _read(qemu_err).strip()
        why += f"; qemu exit {proc.returncode}" + (f": {qerr.splitlines()[-1]}" if qerr else "")
        failure = why
    if failure is not None:
        alarm = _console_problems(cons)
        if alarm:
            failure += f"; the guest kernel reported: {alarm}"
        raise VMError(f"VM run failed: {failure}; files in {out}", cons, output)
    rc = int(rc_text)
    res = VMResult(rc=rc, output=output, dmesg=_read(out / "dmesg.txt"), console=cons,
                   boot_s=boot_s if boot_s is not None else wall, wall_s=wall,
                   timed_out=rc == 124 or (rc == 137 and wall - (boot_s or 0) >= timeout),
                   out_dir=out, clock=clock, kernel=art.kernel.version)
    if made_out:
        log.debug("job files kept in %s", out)
    return res


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run a command as root inside the flowpacer test VM (qemu TCG, 6.1 kernel).",
        usage="%(prog)s [options] -- COMMAND [ARG...]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the command (600)")
    ap.add_argument("--insmod", action="append", default=[], metavar="FILE.ko",
                    help="load this module before the command (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment variable (repeatable)")
    ap.add_argument("--mem", type=int, default=DEFAULT_MEM_MB, help="guest MiB (%(default)s)")
    ap.add_argument("--smp", type=int, default=DEFAULT_SMP,
                    help="guest CPUs (%(default)s; 1 in virtual time)")
    ap.add_argument("--clock", choices=[c.value for c in Clock], default=None,
                    help="real: plain TCG, host time (default, or $FLOWPACER_VM_CLOCK); virtual: "
                         "exact guest time from the instruction count, one vCPU")
    ap.add_argument("--out", metavar="DIR", help="shared job directory (default: a new /tmp dir)")
    ap.add_argument("--dmesg", action="store_true", help="print the guest's dmesg afterwards")
    ap.add_argument("--keep", action="store_true",
                    help="keep the job directory (kept anyway when the command fails)")
    ap.add_argument("--build-only", action="store_true", help="only build vm/out and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no live output, no summary")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="vm/run: %(message)s")
    if args.build_only:
        try:
            art = vmbuild.build()
        except (vmbuild.BuildError, OSError) as e:
            print(f"vm/run: {e}", file=sys.stderr)
            return 2
        print(f"{art.vmlinux}\n{art.initramfs}")
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given (put it after --)")
    env = {}
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep:
            ap.error(f"--env {kv}: expected K=V")
        env[k] = v

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        res = run(cmd, timeout=args.timeout, env=env, insmod=args.insmod, mem_mb=args.mem,
                  smp=args.smp, out_dir=Path(args.out) if args.out else None,
                  on_output=None if args.quiet else show, clock=args.clock)
    except VMError as e:
        print(f"vm/run: {e.details()}", file=sys.stderr)
        return 125
    if args.quiet:
        sys.stdout.write(res.output)
    if args.dmesg:
        print("--- guest dmesg ---\n" + res.dmesg.rstrip())
    bad = res.dmesg_problems()
    if not args.quiet:
        print(f"vm/run: exit {res.rc}{' (timed out)' if res.timed_out else ''}; "
              f"{res.kernel}, {res.clock.value} clock; boot {res.boot_s:.1f} s, total {res.wall_s:.1f} s; job files in {res.out_dir}",
              file=sys.stderr)
    for ln in bad:
        print(f"vm/run: dmesg: {ln}", file=sys.stderr)
    if args.out is None and res.rc == 0 and not args.keep:
        shutil.rmtree(res.out_dir, ignore_errors=True)
    return res.rc


if __name__ == "__main__":
    sys.exit(main())
