#!/usr/bin/env python3
"""Build the test VM's boot files: an uncompressed vmlinux and a busybox initramfs.

Outputs go to ``vm/out/`` and are rebuilt only when an input changes (the kernel image,
the modules put into the initramfs, busybox, the guest scripts or this file).

    python3 vm/build.py            # build if needed, print the paths
    python3 vm/build.py --force    # rebuild

The kernel is the newest installed ``/boot/vmlinuz-6.1.*`` whose modules directory
``/lib/modules/<version>`` exists; ``FLOWPACER_VM_KERNEL=6.12`` picks the newest 6.12 instead
(Debian 13's kernel, from bookworm-backports), ``=7.3`` trixie-backports' kernel (its image is
``/lib/modules/<version>/vmlinuz``, unpacked by tools/setup.sh), a path names one bzImage.
Only the standard library is used so that ``python3`` works as well as the venv.
"""
from __future__ import annotations

import argparse
import bz2
import dataclasses
import fcntl
import glob
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

log = logging.getLogger(__name__)

VM_DIR = Path(__file__).resolve().parent
OUT_DIR = VM_DIR / "out"
GUEST_DIR = VM_DIR / "guest"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
# What the initramfs must load before it can mount the host's root (virtio-pci, 9p over
# virtio, overlayfs) plus the virtio RNG so that the guest never waits for entropy.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_rng")
BUILD_FORMAT = 1  # bump to force a rebuild when the output layout changes


class BuildError(Exception):
    """The VM boot files cannot be built; the message says why (one line)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    bzimage: Path
    version: str          # e.g. "6.1.0-56-amd64"
    moddir: Path          # /lib/modules/<version>


@dataclasses.dataclass(frozen=True)
class Artifacts:
    kernel: Kernel
    vmlinux: Path
    initramfs: Path
    modules: Tuple[str, ...]   # module files in the initramfs, in load order


# --------------------------------------------------------------------------- kernel

def _version_key(ver: str) -> Tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.\-+~]", ver))


# What the project tests the module on: Debian 12's 6.1, Debian 13's 6.12 (from bookworm-backports
# here), trixie-backports' 7.3 (tools/setup.sh unpacks its image and modules).
KERNEL_SERIES = ("6.1", "6.12", "7.3")
DEFAULT_SERIES = "6.1"
_SETUP_HINTS = {"6.1.": "apt-get install linux-image-amd64 on Debian 12",
                "6.12.": "tools/setup.sh installs it (bookworm-backports)",
                "7.3.": "tools/setup.sh unpacks it from trixie-backports"}


def _image_version(img: Path) -> str:
    """The kernel version of /boot/vmlinuz-<version> or /usr/lib/modules/<version>/vmlinuz."""
    if img.name.startswith("vmlinuz-"):
        return img.name[len("vmlinuz-"):]
    if img.name == "vmlinuz" and img.parent.parent.name == "modules":
        return img.parent.name
    return ""


def find_kernel(pattern: Optional[str] = None) -> Kernel:
    """The newest installed kernel of a series that has its modules directory: a
    /boot/vmlinuz-<series>.* (Debian's linux-image packages) or a
    /lib/modules/<series>.*/vmlinuz (where trixie-backports' linux-binary packages put the
    image, and where tools/setup.sh unpacks 7.3).

    The series is ``pattern`` if given, else ``$FLOWPACER_VM_KERNEL``: a series such as "6.1",
    "6.12" or "7.3" (the dot after it is implied, so that 6.12 is not taken for 6.1), or the
    path of such an image file; default "6.1"."""
    override = None if pattern else os.environ.get("FLOWPACER_VM_KERNEL", "").strip()
    if override and "/" in override:
        candidates = [Path(override)]
    else:
        series = (pattern or override or DEFAULT_SERIES).rstrip(".")
        if not re.fullmatch(r"\d+\.\d+", series):
            raise BuildError(f"FLOWPACER_VM_KERNEL={series}: a kernel series such as "
                             f"{', '.join(KERNEL_SERIES)}, or a /boot/vmlinuz-<version> path")
        pattern = series + "."
        candidates = [Path(p) for p in glob.glob(f"/boot/vmlinuz-{pattern}*")
                      + glob.glob(f"/lib/modules/{pattern}*/vmlinuz")]
    found = {}
    for img in candidates:
        ver = _image_version(img)
        moddir = Path("/lib/modules") / ver
        if ver and img.is_file() and (moddir / "modules.dep").is_file():
            found.setdefault(ver, Kernel(img, ver, moddir))
    if not found:
        hint = _SETUP_HINTS.get(pattern or "", "tools/setup.sh")
        raise BuildError(
            f"no /boot/vmlinuz-{pattern}* or /lib/modules/{pattern}*/vmlinuz with a "
            f"/lib/modules/<version>/modules.dep ({hint})"
            if not (override and "/" in override) else
            f"FLOWPACER_VM_KERNEL={override}: not a vmlinuz-<version> or "
            f"modules/<version>/vmlinuz file with its modules")
    return max(found.values(), key=lambda k: _version_key(k.version))


# Compressed-payload magics and the host tool that undoes each (the kernel appends the
# uncompressed size after some payloads: tools may complain about trailing data, so the
# output is judged by whether it is a whole ELF file, not by the exit status alone).
_DECOMPRESSORS = (
    (b"\x1f\x8b", ["gzip", "-dc"]),
    (b"\xfd7zXZ\x00", ["xz", "-dc", "--single-stream"]),
    (b"\x28\xb5\x2f\xfd", ["zstd", "-dc"]),
    (b"\x02\x21\x4c\x18", ["lz4", "-dc"]),
    (b"BZh", ["bzip2", "-dc"]),
    (b"\x89LZO", ["lzop", "-dc"]),
    (b"\x5d\x00\x00", ["xz", "-dc", "--format=lzma"]),
)


def _elf_complete(data: bytes) -> bool:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:  # ELFCLASS64
        return False
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(e_phoff + e_phentsize * e_phnum, e_shoff + e_shentsize * e_shnum)
    return end <= len(data)


def _elf_has_pvh_note(data: bytes) -> bool:
    """True when the ELF carries XEN_ELFNOTE_PHYS32_ENTRY (qemu boots it via PVH)."""
    e_phoff = struct.unpack_from("<Q", data, 0x20)[0]
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, _flags, p_offset = struct.unpack_from("<IIQ", data, off)
        p_filesz = struct.unpack_from("<Q", data, off + 32)[0]
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            name = data[pos + 12:pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == 18:
                return True
            pos += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return False


def _decompress_stdlib(tool: str, payload: bytes) -> bytes:
    try:
        if tool == "xz":
            return lzma.LZMADecompressor().decompress(payload)
        if tool == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
        if tool == "bzip2":
            return bz2.BZ2Decompressor().decompress(payload)
    except (lzma.LZMAError, zlib.error, OSError, EOFError):
        pass
    return b""


def extract_vmlinux(bzimage: Path, dest: Path) -> None:
    """Write the ELF vmlinux inside ``bzimage`` to ``dest`` using the matching host tool."""
    data = bzimage.read_bytes()
    if len(data) < 0x250 or data[0x202:0x206] != b"HdrS":
        raise BuildError(f"{bzimage}: not a bzImage (no HdrS boot header)")
    version = struct.unpack_from("<H", data, 0x206)[0]
    setup_sects = data[0x1F1] or 4
    pm_start = (setup_sects + 1) * 512
    payload = None
    if version >= 0x208:
        p_off, p_len = struct.unpack_from("<II", data, 0x248)
        payload = data[pm_start + p_off:pm_start + p_off + p_len]
    tool = None
    if payload:
        tool = next((cmd for magic, cmd in _DECOMPRESSORS if payload.startswith(magic)), None)
    if tool is None:  # older header or unknown layout: search for a known magic
        for magic, cmd in _DECOMPRESSORS[:-1]:
            pos = data.find(magic, pm_start)
            if pos >= 0:
                payload, tool = data[pos:], cmd
                break
    if tool is None:
        raise BuildError(f"{bzimage}: no known compressed payload found")
    if shutil.which(tool[0]) is not None:
        proc = subprocess.run(tool, input=payload, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, check=False)
        elf = proc.stdout
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        why = f"exit {proc.returncode}: {err[-1] if err else 'no message'}"
    else:  # the standard library knows some formats: use it rather than fail
        elf, why = _decompress_stdlib(tool[0], payload), f"'{tool[0]}' is not installed"
    if not _elf_complete(elf):
        raise BuildError(f"{bzimage}: '{' '.join(tool)}' gave no complete ELF ({why})")
    if not _elf_has_pvh_note(elf):
        raise BuildError(f"{bzimage}: the kernel has no PVH entry note (needs CONFIG_PVH=y)")
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(elf)
    os.replace(tmp, dest)


# --------------------------------------------------------------------------- modules

def module_files(kernel: Kernel, names: Iterable[str] = INITRAMFS_MODULES) -> List[Tuple[Path, str]]:
    """(file, params) in load order for ``names`` and their dependencies."""
    out: List[Tuple[Path, str]] = []
    seen = set()
    for name in names:
        proc = subprocess.run(["modprobe", "-S", kernel.version, "--show-depends", name],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BuildError(f"modprobe --show-depends {name} for {kernel.version}: "
                             f"{proc.stderr.strip() or 'failed'}")
        for line in proc.stdout.splitlines():
            parts = line.split(None, 2)
            if len(parts) >= 2 and parts[0] == "insmod":
                path = Path(parts[1])
                if path not in seen:
                    seen.add(path)
                    out.append((path, parts[2].strip() if len(parts) > 2 else ""))
            # "builtin NAME" lines need nothing
    return out


# --------------------------------------------------------------------------- cpio

class CpioWriter:
    """A minimal writer of the "newc" cpio format that the kernel unpacks."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: Tuple[int, int] = (0, 0),
               nlink: int = 1) -> None:
        name_b = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1],
            len(name_b), 0))
        self.ino += 1
        self.buf.write(hdr.encode() + name_b)
        self.buf.write(b"\0" * (-(110 + len(name_b)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        data = self.buf.getvalue()
        return data + b"\0" * (-len(data) % 512)


def find_busybox() -> Path:
    for cand in BUSYBOX_CANDIDATES:
        p = Path(cand)
        if p.is_file():
            head = p.read_bytes()[:4096]
            # a static binary has no PT_INTERP: cheap check, the "file" tool is not needed
            if b"/lib64/ld-linux" not in head and b"ld-linux" not in head:
                return p
    raise BuildError("no static busybox (apt-get install busybox-static)")


def _module_bytes(path: Path) -> Tuple[str, bytes]:
    """(file name, contents) of a module, decompressed (busybox insmod wants a plain .ko)."""
    data = path.read_bytes()
    name = path.name
    if name.endswith(".ko.xz"):
        return name[:-3], lzma.decompress(data)
    if name.endswith(".ko.gz"):
        return name[:-3], gzip.decompress(data)
    if name.endswith(".ko.zst"):
        proc = subprocess.run(["zstd", "-dc"], input=data, capture_output=True, check=False)
        if proc.returncode != 0:
            raise BuildError(f"{path}: zstd -dc failed (apt-get install zstd)")
        return name[:-4], proc.stdout
    return name, data


def build_initramfs(kernel: Kernel, modules: List[Tuple[Path, str]], busybox: Path,
                    dest: Path) -> None:
    cpio = CpioWriter()
    for d in ("bin", "dev", "proc", "sys", "run", "tmp", "lower", "upper", "newroot", "lib",
              "lib/modules", f"lib/modules/{kernel.version}"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3, 0o666)
    cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
    cpio.symlink("bin/sh", "busybox")
    listing = []
    for path, params in modules:
        base, data = _module_bytes(path)
        name = f"lib/modules/{kernel.version}/{base}"
        cpio.file(name, data)
        listing.append(f"/{name} {params}".rstrip())
    cpio.file("modules.list", ("\n".join(listing) + "\n").encode())
    cpio.file("init", (GUEST_DIR / "init").read_bytes(), 0o755)
    cpio.file("stage2.sh", (GUEST_DIR / "stage2.sh").read_bytes(), 0o755)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(cpio.finish())
    os.replace(tmp, dest)


# --------------------------------------------------------------------------- cache

def _fingerprint(kernel: Kernel, modules: List[Tuple[Path, str]], busybox: Path) -> str:
    h = hashlib.sha256()

    def add_stat(p: Path) -> None:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}\n".encode())

    h.update(f"format {BUILD_FORMAT}\n".encode())
    add_stat(kernel.bzimage)
    add_stat(busybox)
    for p, params in modules:
        add_stat(p)
        h.update(params.encode())
    for p in (Path(__file__).resolve(), GUEST_DIR / "init", GUEST_DIR / "stage2.sh"):
        h.update(p.read_bytes())
    return h.hexdigest()


def build(force: bool = False, out_dir: Optional[Path] = None,
          series: Optional[str] = None) -> Artifacts:
    """Build (or reuse) the boot files for the newest kernel of ``series`` (default:
    ``$FLOWPACER_VM_KERNEL``, see ``find_kernel``). Safe to call from concurrent processes."""
    out_dir = Path(out_dir or OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel = find_kernel(series)
    busybox = find_busybox()
    modules = module_files(kernel)
    vmlinux = out_dir / f"vmlinux-{kernel.version}"
    initramfs = out_dir / f"initramfs-{kernel.version}.cpio"
    manifest = out_dir / f"manifest-{kernel.version}.json"
    fp = _fingerprint(kernel, modules, busybox)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = {}
        try:
            old = json.loads(manifest.read_text())
        except (OSError, ValueError):
            pass
        fresh = (not force and old.get("fingerprint") == fp and vmlinux.is_file()
                 and initramfs.is_file())
        if not fresh:
            if force or old.get("bzimage_stat") != _stat_key(kernel.bzimage) or not vmlinux.is_file():
                log.info("extracting %s -> %s", kernel.bzimage, vmlinux)
                extract_vmlinux(kernel.bzimage, vmlinux)
            log.info("building %s (%d modules)", initramfs, len(modules))
            build_initramfs(kernel, modules, busybox, initramfs)
            manifest.write_text(json.dumps({
                "fingerprint": fp, "kernel": str(kernel.bzimage), "version": kernel.version,
                "bzimage_stat": _stat_key(kernel.bzimage),
                "modules": [str(p) for p, _ in modules]}, indent=1))
    return Artifacts(kernel, vmlinux, initramfs, tuple(str(p) for p, _ in modules))


def _stat_key(p: Path) -> str:
    st = p.stat()
    return f"{p}:{st.st_size}:{st.st_mtime_ns}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="vm/build: %(message)s")
    try:
        art = build(force=args.force)
    except (BuildError, OSError) as e:
        print(f"vm/build: {e}", file=sys.stderr)
        return 1
    print(f"kernel    {art.kernel.bzimage} ({art.kernel.version})")
    print(f"vmlinux   {art.vmlinux}")
    print(f"initramfs {art.initramfs} ({len(art.modules)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
