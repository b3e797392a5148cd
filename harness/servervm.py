"""A Debian 13 server in the qemu VM (issue 27 item 4, issue 28 item 4): trixie's own root,
kernel and systemd as PID 1, not the host's root that ``vm/run.py`` shares.

The root is a trixie minbase made by mmdebstrap (``debroot.base_tar``, cached for a week in
/var/cache/flowpacer-test) with systemd, nginx, curl, iperf3, trixie's kernel image and headers, dkms and
gcc, and the Python packages flowpacer depends on (so that ``apt-get install ./x.deb`` in the
guest, which has no network, finds every dependency installed), unpacked once next to its tar.
The guest boots trixie's kernel (``/boot/vmlinuz-*`` of the root) with a busybox initramfs that
loads virtio/9p/overlay from the root's own modules, mounts the root read-only over 9p under a
tmpfs overlay, adds the job's unit, and hands over to ``/sbin/init`` (systemd). The job
(``vm/server/job.py``, the root's python3) runs as a oneshot service once multi-user.target is
reached, writes its results into the shared directory and powers the guest off.

sch_psp is not compiled in the guest (DKMS under TCG took 266-332 s of the case): ``dkms_tarball``
installs the sch-psp-dkms .deb in a throwaway overlay of the same root on the host (chrooted,
native speed), where the package's own postinst has DKMS build the module for the root's kernel
with that kernel's headers, the package's dkms.conf and Makefile and trixie's gcc-14, and packs
the result with ``dkms mktarball --binaries-only``. The guest's apt then loads that tarball
instead of building (see vm/server/job.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

from harness import debroot
from vm import build as vmbuild
from vm.run import CPU, QEMU

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "vm" / "server" / "job.py"
PACKAGES = ("systemd", "systemd-sysv", "udev", "iproute2", "kmod", "procps", "nginx", "curl",
            "iperf3", "python3", "python3-click", "python3-pyroute2", "python3-yaml",
            "python3-prometheus-client", "dkms", "gcc", "make", "linux-headers-amd64",
            "linux-image-amd64")
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_rng")

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "fp-server-vm: FAIL: $*"; poweroff -f; sleep 5; echo o > /proc/sysrq-trigger; }
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
while read -r mod params; do
    [ -n "$mod" ] || continue
    insmod "$mod" $params || fail "insmod $mod"
done < /modules.list
P9="trans=virtio,version=9p2000.L,msize=262144"
mount -t 9p -o "$P9,ro,cache=loose" fproot /lower || fail "mount 9p fproot"
mount -t tmpfs -o mode=0755 tmpfs /upper || fail "tmpfs"
mkdir -p /upper/upper /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/upper,workdir=/upper/work overlay /newroot \
    || fail "overlay"
N=/newroot
mkdir -p $N/fp-out
mount -t 9p -o "$P9,cache=none" fpout $N/fp-out || fail "mount 9p fpout"
cp /fp-job.service $N/etc/systemd/system/fp-job.service
mkdir -p $N/etc/systemd/system/multi-user.target.wants
ln -sf /etc/systemd/system/fp-job.service $N/etc/systemd/system/multi-user.target.wants/
echo fp-server > $N/etc/hostname
# not a first boot (no firstboot prompts on the console): a fixed machine id
echo 0f1f0f1f0f1f0f1f0f1f0f1f0f1f0f1f > $N/etc/machine-id
# /etc and /var are up to date with /usr (mmdebstrap ran every trigger), as systemd-update-done
# records after a first boot: without it ConditionNeedsUpdate= reruns ldconfig, hwdb and the
# journal catalog under TCG at every boot
touch $N/etc/.updated $N/var/.updated
umount /proc /sys /dev 2>/dev/null
exec switch_root $N /sbin/init
fail "switch_root"
"""

JOB_UNIT = """[Unit]
Description=flowpacer server VM job
After=multi-user.target nginx.service

[Service]
Type=oneshot
ExecStart=/usr/bin/python3 /fp-out/job.py
StandardOutput=append:/fp-out/output.log
StandardError=append:/fp-out/output.log
TimeoutStartSec=infinity
ExecStopPost=/bin/sh -c 'echo $EXIT_STATUS > /fp-out/rc; systemctl --no-block poweroff'
"""


class ServerVMError(Exception):
    pass


# The kernel's module tree in the root, cut to what a virtual server uses (what the VM's
# hardware, the job's veth/ifb/qdiscs/filters, nftables and the file systems need): the package's
# DKMS install runs depmod, which reads every module file over 9p and unpacks it under TCG (4200
# .ko.xz files: ~250 s of the case's apt step, against ~10 s natively). The modules a real trixie
# server has do not change what is tested; the root's own depmod indexes the rest.
KEEP_DRIVERS = ("virtio", "net", "block", "char", "md")
DROP_NET_DRIVERS = ("arcnet", "can", "ethernet", "fddi", "hamradio", "hippi", "hyperv",
                    "ieee802154", "plip", "slip", "thunderbolt", "usb", "vmxnet3", "wan",
                    "wireless", "wwan", "xen-netback", "phy", "pcs", "mdio")


def _slim_modules(d: Path) -> int:
    """Drop the modules no virtual server loads from root ``d`` (see KEEP_DRIVERS); how many
    module files are left."""
    left = 0
    for kdir in sorted((d / "lib" / "modules").glob("*/kernel")):
        drop = [kdir / "sound"] + [p for p in (kdir / "drivers").iterdir()
                                   if p.name not in KEEP_DRIVERS]
        drop += [kdir / "drivers" / "net" / n for n in DROP_NET_DRIVERS]
        for p in drop:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        ver = kdir.parent.name
        debroot.run(["chroot", str(d), "depmod", ver], 300, f"depmod {ver} in the server root")
        left += sum(1 for _ in kdir.rglob("*.ko*"))
    return left


def root_dir() -> Path:
    """The trixie server root, unpacked once next to its cached tar, its module tree slimmed
    (call under cache_lock)."""
    tar = debroot.base_tar("trixie", PACKAGES)
    d = tar.with_suffix(".d")
    stamp = d / ".fp-unpacked-slim"
    if stamp.exists() and stamp.stat().st_mtime >= tar.stat().st_mtime:
        return d
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    debroot.run(["tar", "-C", str(d), "-xf", str(tar)], 600, "unpack the trixie server root")
    (d / "etc/dpkg/dpkg.cfg.d/test-unsafe-io").write_text("force-unsafe-io\n")
    _slim_modules(d)
    stamp.touch()
    return d


# The host side of dkms_tarball: $1 (the root) as the lower layer of an overlay mounted on $4,
# the changes in $2 (work dir $3), then debroot.IN_ROOT's chroot of $4 with its own mounts. All in
# new mount and pid namespaces: the overlay and every process go when the script ends.
ON_OVERLAY = r"""
L=$1; U=$2; W=$3; shift 3
mount -t overlay -o "lowerdir=$L,upperdir=$U,workdir=$W" overlay "$1"
""" + debroot.IN_ROOT

BUILD_MODULE = r"""
dpkg -i /root/fp-build/{deb}
kver={kver}
src=$(ls -d /usr/src/sch_psp-*)
ver=${{src#/usr/src/sch_psp-}}
dkms status -m sch_psp -v "$ver" -k "$kver" | grep -q ': installed' || {{
    dkms status; cat /var/lib/dkms/sch_psp/"$ver"/build/make.log 2>/dev/null; exit 1; }}
dkms mktarball -m sch_psp -v "$ver" -k "$kver" --binaries-only \
    --archive "/root/fp-build/sch_psp-$ver.dkms.tar.gz"
"""


def module_key(root: Path, psp_deb: Path) -> str:
    """What a DKMS build of the package in ``root`` depends on: the root as unpacked (its kernel
    and headers; remade when its tar is) and the module's source files in the .deb."""
    h = hashlib.sha256()
    stamp = root / ".fp-unpacked"
    h.update(f"{kernel_of(root).version} {stamp.stat().st_mtime_ns if stamp.exists() else 0}\n".encode())
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(psp_deb)], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for m in sorted(t.getmembers(), key=lambda m: m.name):
            if m.isfile() and m.name.lstrip("./").startswith("usr/src/"):
                h.update(m.name.encode() + b"\0" + t.extractfile(m).read() + b"\0")
    return h.hexdigest()[:16]


def dkms_tarball(root: Path, psp_deb: Path, work: Path, cache: Optional[Path] = None) -> Path:
    """sch_psp built by DKMS for the root's kernel on the host, in an overlay of ``root`` (which
    stays as it is): the sch-psp-dkms .deb installed there with dpkg (its postinst builds the
    module for every kernel with headers in the root, as in tests/test_deb.py), then ``dkms
    mktarball --binaries-only``. Returns SCH_PSP-VERSION.dkms.tar.gz, the name the package's
    postinst looks for (dkms's common.postinst: /usr/share/sch_psp-dkms/), in ``work``.

    With ``cache`` (a directory; hold debroot.cache_lock): the tarball of an earlier build with
    the same ``module_key`` is reused, and a new one is kept there (the last one only)."""
    key = module_key(root, psp_deb)
    if cache is not None:
        kept = sorted(cache.glob(f"dkms-{key}-sch_psp-*.dkms.tar.gz"))
        if kept:
            work.mkdir(parents=True, exist_ok=True)
            out = work / kept[0].name[len(f"dkms-{key}-"):]
            shutil.copy(kept[0], out)
            return out
    out = _dkms_build(root, psp_deb, work)
    if cache is not None:
        for old in cache.glob("dkms-*-sch_psp-*.dkms.tar.gz"):
            old.unlink()
        shutil.copy(out, cache / f"dkms-{key}-{out.name}")
    return out


def _dkms_build(root: Path, psp_deb: Path, work: Path) -> Path:
    k = kernel_of(root)
    shutil.rmtree(work, ignore_errors=True)
    upper, wdir, merged, cache = (work / n for n in ("upper", "work", "merged", "archives"))
    for d in (upper / "root" / "fp-build", wdir, merged, cache):
        d.mkdir(parents=True)
    shutil.copy(psp_deb, upper / "root" / "fp-build" / psp_deb.name)
    script = BUILD_MODULE.format(deb=shlex.quote(psp_deb.name), kver=shlex.quote(k.version))
    argv = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
            "sh", "-ec", ON_OVERLAY, "sh", str(root), str(upper), str(wdir), str(merged),
            str(cache), "sh", "-ec", script]
    p = debroot.run(argv, 600, f"DKMS build of sch_psp for {k.version} in an overlay of {root}")
    found = sorted((upper / "root" / "fp-build").glob("sch_psp-*.dkms.tar.gz"))
    if len(found) != 1:
        raise ServerVMError(f"no DKMS tarball made: {found}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    out = work / found[0].name
    shutil.move(str(found[0]), out)
    shutil.rmtree(upper, ignore_errors=True)
    shutil.rmtree(wdir, ignore_errors=True)
    return out


def kernel_of(root: Path) -> vmbuild.Kernel:
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if not images:
        raise ServerVMError(f"no kernel image in {root}/boot")
    img = images[-1]
    ver = img.name[len("vmlinuz-"):]
    return vmbuild.Kernel(img, ver, root / "lib/modules" / ver)


def _modules(root: Path, ver: str) -> List[Tuple[Path, str]]:
    out, seen = [], set()
    for name in MODULES:
        p = subprocess.run(["modprobe", "-d", str(root), "-S", ver, "--show-depends", name],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise ServerVMError(f"modprobe --show-depends {name} in {root}: {p.stderr.strip()}")
        for line in p.stdout.splitlines():
            parts = line.split(None, 2)
            if len(parts) >= 2 and parts[0] == "insmod":
                path = Path(parts[1])
                if not str(path).startswith(str(root)):
                    path = root / str(path).lstrip("/")
                if path not in seen:
                    seen.add(path)
                    out.append((path, parts[2].strip() if len(parts) > 2 else ""))
    return out


def boot_files(root: Path, out: Path) -> Tuple[vmbuild.Kernel, Path, Path]:
    """(kernel, vmlinux, initramfs) for the root's kernel, made in ``out``."""
    k = kernel_of(root)
    vmlinux = out / f"vmlinux-{k.version}"
    vmbuild.extract_vmlinux(k.bzimage, vmlinux)
    cpio = vmbuild.CpioWriter()
    for d in ("bin", "dev", "proc", "sys", "run", "tmp", "lower", "upper", "newroot", "lib",
              "lib/modules", f"lib/modules/{k.version}"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3, 0o666)
    cpio.file("bin/busybox", vmbuild.find_busybox().read_bytes(), 0o755)
    cpio.symlink("bin/sh", "busybox")
    listing = []
    for path, params in _modules(root, k.version):
        base, data = vmbuild._module_bytes(path)
        name = f"lib/modules/{k.version}/{base}"
        cpio.file(name, data)
        listing.append(f"/{name} {params}".rstrip())
    cpio.file("modules.list", ("\n".join(listing) + "\n").encode())
    cpio.file("init", INIT.encode(), 0o755)
    cpio.file("fp-job.service", JOB_UNIT.encode())
    initramfs = out / "initramfs.cpio"
    initramfs.write_bytes(cpio.finish())
    return k, vmlinux, initramfs


def run(root: Path, out: Path, files: dict, timeout: float = 1500, mem_mb: int = 2048,
        smp: int = 2) -> dict:
    """Boot the server VM with ``files`` ({name: path on the host}) copied into the shared
    directory ``out`` next to the job; the job's result (result.json), its output, the
    console and the times."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("rc", "result.json", "output.log", "console.log"):
        (out / name).unlink(missing_ok=True)
    shutil.copy(JOB, out / "job.py")
    for name, path in files.items():
        shutil.copy(path, out / name)
    k, vmlinux, initramfs = boot_files(root, out)
    console = out / "console.log"
    argv = [QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-machine", "q35", "-accel", "tcg", "-cpu", os.environ.get("FLOWPACER_VM_CPU", CPU),
            "-m", str(mem_mb), "-smp", str(smp), "-kernel", str(vmlinux), "-initrd", str(initramfs),
            "-append", "console=ttyS0 panic=-1 tsc=reliable mitigations=off init_on_alloc=0 "
                       "rdinit=/init systemd.show_status=1 systemd.firstboot=no net.ifnames=0",
            "-serial", f"file:{console}",
            "-virtfs", f"local,path={root},mount_tag=fproot,security_model=none,readonly=on,"
                       "multidevs=remap",
            "-virtfs", f"local,path={out},mount_tag=fpout,security_model=none",
            "-device", "virtio-rng-pci"]
    t0 = time.monotonic()
    with open(out / "qemu.stderr", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                process_group=0)   # the lane's session: harness.lanes.UNTIMED_NICE
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ServerVMError(f"the server VM did not finish in {timeout:.0f} s; files in {out}\n"
                            + _tail(out / "output.log") + _tail(console))
    wall = time.monotonic() - t0
    rc = (out / "rc").read_text().strip() if (out / "rc").exists() else ""
    res = {"rc": rc, "wall_s": wall, "kernel": k.version, "output": _tail(out / "output.log", 20000),
           "console": _tail(console, 6000)}
    try:
        res["result"] = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        res["result"] = None
    return res


def _tail(p: Path, n: int = 4000) -> str:
    try:
        return p.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def bumped_deb(deb: Path, dest_dir: Path, suffix: str = "+fpupgrade1") -> Path:
    """The same package with its version bumped (an upgrade as apt sees one: prerm upgrade,
    the new files, postinst configure OLD-VERSION)."""
    work = dest_dir / "bump"
    shutil.rmtree(work, ignore_errors=True)
    debroot.run(["dpkg-deb", "-R", str(deb), str(work)], 120, "dpkg-deb -R")
    ctl = work / "DEBIAN" / "control"
    text = ctl.read_text()
    ver = next(line.split(":", 1)[1].strip() for line in text.splitlines()
               if line.startswith("Version:"))
    ctl.write_text(text.replace(f"Version: {ver}", f"Version: {ver}{suffix}"))
    out = dest_dir / f"flowpacer_{ver}{suffix}_all.deb"
    debroot.run(["dpkg-deb", "--root-owner-group", "-b", str(work), str(out)], 300, "dpkg-deb -b")
    shutil.rmtree(work)
    return out


__all__ = ["root_dir", "run", "bumped_deb", "dkms_tarball", "ServerVMError", "PACKAGES", "shlex"]
