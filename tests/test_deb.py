"""The Debian packages (issues 18, 27): `make deb`, then a real install in clean Debian 13 and
Debian 12 roots.

- `make deb` builds flowpacer_*.deb and sch-psp-dkms_*.deb with debhelper, pybuild and dh-dkms;
  lintian reports no error and no warning, and the packages hold what they should.
- For each release, trixie (13) and bookworm (12), a minbase root is made with mmdebstrap
  (harness/debroot.py), with what an admin's server has beside the packages: systemd, man-db,
  the headers of the release's kernel (linux-headers-amd64: trixie 6.12, bookworm 6.1) and of a
  kernel from its backports (trixie-backports' 7.3.4, linux-headers-7.3.4+deb13-amd64, which
  builds with trixie's gcc-14; bookworm-backports' 6.12). A kernel image that a headers package
  requires (trixie's 6.12, bookworm-backports' 6.12) is stood for by a stub package: only the
  headers build modules.
- apt resolves the two files' dependencies from the archive (`apt-get install -s ./...deb`): they
  include Debian's python3-pyroute2, -yaml, -click, -prometheus-client, -bpfcc and dkms, and
  they are installed from the archive. The root's file list is taken, then
  `apt-get install ./flowpacer_*.deb ./sch-psp-dkms_*.deb` installs just the two.
- DKMS built sch_psp in the postinst for both kernels of the root (their versions differ from
  `uname -r`, so dkms is asked about each one explicitly), without a compiler warning; the unit is installed,
  not enabled, and `systemd-analyze verify` accepts it (its ExecStart, ExecReload and the man
  pages of Documentation= exist); `flowpacer rules check /etc/flowpacer/rules.yaml` passes.
- An admin edits the rules (`flowpacer rules edit` leaves rules.yaml.bak and .lock), then
  `apt-get purge flowpacer sch-psp-dkms`: the root's file list is again what it was before the
  install, but for dpkg's, apt's and the loader's own records.

Every command in the root runs in its own mount and pid namespaces (`unshare`): /proc, /sys, a
minimal /dev, /run, /tmp and the package cache are mounted there only, so nothing stays mounted
and no process stays behind when a command ends, also on failure or timeout; each release's root
(in pytest's tmp dir) is deleted when its tests are done.

The base roots (tars) and the downloaded packages are cached in /var/cache/flowpacer-test
(FLOWPACER_TEST_CACHE): a base is made again when it is older than a week. Timings:
docs/packaging.md.
"""
import os
import re
import shutil
from pathlib import Path

import pytest

from harness import package
from harness.debroot import (CACHE, Root, backports, base_tar, cache_lock as _cache_lock,
                             mounts_under, run, stub_deb)

pytestmark = pytest.mark.deb

ROOT = Path(__file__).resolve().parent.parent
# What the purge may leave changed: dpkg's and apt's records, logs, caches, the loader's cache,
# depmod's indexes of the module directories (a real system has them from its kernel image), and
# dkms's module signing key, made at its first build: it belongs to dkms (which stays installed)
# and to every module it signs, and may be enrolled in the machine's MOK list.
NOISE = re.compile(r"^(var/lib/dpkg/|var/lib/apt/|var/log/|var/cache/|etc/ld\.so\.cache$"
                   r"|(usr/)?lib/modules/[^/]+/modules\.|var/lib/dkms/mok\.(key|pub)$)")

# Per release: the headers an admin's server has (the release's default kernel, and the kernel
# of its backports: the headers package to install from there, None for the newest
# linux-headers-amd64 of backports) and the kernel series they must be for.
RELEASES = {
    "trixie": {"backports_headers": "linux-headers-7.3.4+deb13-amd64", "series": ("6.12.", "7.3.4+")},
    "bookworm": {"backports_headers": None, "series": ("6.1.", "6.12.")},
}
# Inst lines of kernel image packages in an apt simulation: the headers depend on them
IMAGE_INST = re.compile(r"^Inst (linux-(?:image|binary|modules)-\S+) (?:\[\S+\] )?\((\S+)", re.M)


@pytest.fixture(scope="module")
def cache_lock(root):
    """One user of the cache at a time (apt's archive lock is in it)."""
    with _cache_lock():
        yield


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    """`make deb` into a tmp dir: (flowpacer deb, sch-psp-dkms deb, make's output)."""
    out = tmp_path_factory.mktemp("deb")
    p = run(["make", "-C", str(ROOT), "deb", f"DEB_OUT={out}"], 600, "make deb")
    found = {}
    for name in ("flowpacer", "sch-psp-dkms"):
        hits = sorted(out.glob(f"{name}_*_all.deb"))
        assert len(hits) == 1, f"make deb made {hits} for {name}"
        found[name] = hits[0]
    return found["flowpacer"], found["sch-psp-dkms"], p.stdout + p.stderr


@pytest.fixture(scope="module", params=list(RELEASES))
def chroot(request, root, cache_lock, tmp_path_factory):
    """The prepared root of a release: base, systemd, man-db, the headers of the release's kernel
    and of its backports' kernel (their kernels' versions as `.kernels`, `.release`). Deleted
    afterwards."""
    release = request.param
    conf = RELEASES[release]
    path = tmp_path_factory.mktemp(f"debroot-{release}")
    r = Root(path)
    r.release = release
    try:
        r.unpack(base_tar(release), release, [backports(release)])
        # the test's own packages (the stub, the debs) are given to apt from here
        (path / "srv/fptest").mkdir(parents=True)
        r.sh("apt-get update -qq", what=f"apt-get update in the {release} root")
        r.sh("apt-get install -y -q --no-install-recommends systemd man-db",
             timeout=600, what="install systemd and man-db")
        # the headers of the release's kernel and of the backports' kernel; the images they
        # depend on (trixie's 6.12, bookworm-backports' 6.12) are stood for by a stub
        hdr_pkg = conf["backports_headers"]
        if hdr_pkg is None:    # the newest linux-headers-amd64 of backports names its headers
            show = r.sh("apt-cache show linux-headers-amd64").stdout
            bpo = [s for s in show.split("\n\n") if re.search(r"^Version: .*~bpo", s, re.M)]
            assert bpo, f"no linux-headers-amd64 from {release}-backports:\n{show}"
            headers = re.search(r"^Depends: (linux-headers-\S+-amd64) \(= \S+\)", bpo[0], re.M)
            assert headers, bpo[0]
            hdr_pkg = headers.group(1)
        hdr_pkg = f"linux-headers-amd64 {hdr_pkg}"
        sim = r.sh(f"apt-get install -s --no-install-recommends {hdr_pkg}",
                   what=f"apt-get install -s {hdr_pkg}").stdout
        images = IMAGE_INST.findall(sim)
        extra = ""
        if images:
            stub = stub_deb(path / "srv/fptest", images)
            extra = f"/srv/fptest/{stub.name}"
        r.sh(f"apt-get install -y -q --no-install-recommends {extra} {hdr_pkg}",
             timeout=600, what=f"install {hdr_pkg}")
        r.kernels = sorted(os.listdir(path / "lib/modules"),
                           key=lambda k: [int(x) for x in re.findall(r"\d+", k.split("-")[0])])
        assert len(r.kernels) == 2 and all(k.startswith(s) for k, s in zip(r.kernels, conf["series"])), \
            (r.kernels, conf["series"])
        yield r
    finally:
        left = mounts_under(path)
        assert not left, f"mounts left under the test root: {left}"
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(chroot, debs):
    """The two packages installed in the root, their dependencies first from the archive.
    (simulated install, install output, the root's files before the packages)"""
    fp, psp, _ = debs
    for d in (fp, psp):
        shutil.copy(d, chroot.path / "srv/fptest")
    files = f"/srv/fptest/{fp.name} /srv/fptest/{psp.name}"
    sim = chroot.sh(f"apt-get install -s {files}", what="apt-get install -s (resolution)").stdout
    deps = [m.group(1) for m in re.finditer(r"^Inst (\S+)", sim, re.M)
            if m.group(1) not in ("flowpacer", "sch-psp-dkms")]
    if deps:
        chroot.sh(f"apt-get install -y -q {' '.join(deps)}", timeout=600,
                  what="install the packages' dependencies from the archive")
    make_mok_key(chroot.path)
    before = chroot.files()
    inst = chroot.sh(f"apt-get install -y {files}", timeout=600,
                     what="apt-get install ./flowpacer_*.deb ./sch-psp-dkms_*.deb")
    return sim, inst.stdout + inst.stderr, before


# The MOK key pair an admin enrolls for DKMS (docs/packaging.md, "Module signing"), made before
# the packages are installed: dkms 3.x signs every module it builds with it
MOK_CN = "flowpacer test MOK"


def make_mok_key(root: Path) -> None:
    """/var/lib/dkms/mok.key and mok.pub (DER) in the root, made with the host's openssl as
    dkms itself would (its own CN is "DKMS module signing key")."""
    d = root / "var/lib/dkms"
    d.mkdir(parents=True, exist_ok=True)
    run(["openssl", "req", "-new", "-x509", "-nodes", "-days", "36500", "-subj", f"/CN={MOK_CN}",
         "-newkey", "rsa:2048", "-keyout", str(d / "mok.key"), "-outform", "DER",
         "-out", str(d / "mok.pub")], 120, "openssl req (the MOK key pair)")
    (d / "mok.key").chmod(0o600)


def mok_serial(root: Path) -> str:
    """The certificate's serial as modinfo's sig_key shows it: hex, upper case, no colons."""
    out = run(["openssl", "x509", "-inform", "DER", "-in", str(root / "var/lib/dkms/mok.pub"),
               "-noout", "-serial"], 60, "openssl x509 -serial").stdout
    return out.strip().split("=", 1)[1].upper().lstrip("0")


# ------------------------------------------------------------------ the build

@pytest.mark.untimed
def test_make_deb_builds_both_packages_lintian_clean(debs):
    fp, psp, out = debs
    lint = [line for line in out.splitlines() if re.match(r"^[EW]: ", line)]
    assert not lint, "lintian:\n" + "\n".join(lint)

    def contents(deb):
        p = run(["dpkg-deb", "-c", str(deb)], 60, "dpkg-deb -c")
        return {line.split()[5].lstrip(".") for line in p.stdout.splitlines()}

    def field(deb, name):
        return run(["dpkg-deb", "-f", str(deb), name], 60, "dpkg-deb -f").stdout.strip()

    have = contents(fp)
    for path in ("/usr/bin/flowpacer", "/lib/systemd/system/flowpacer.service",
                 "/etc/flowpacer/rules.yaml", "/usr/share/man/man8/flowpacer.8.gz",
                 "/usr/share/man/man5/flowpacer-rules.5.gz",
                 "/usr/lib/python3/dist-packages/flowpacer/sources/bpf/flowtrace.c",
                 "/usr/share/doc/flowpacer/examples/example.yaml",
                 "/usr/share/doc/flowpacer/examples/flowpacer-alerts.yml"):
        assert path in have, path
    assert not [p for p in have if "/kmod" in p], "the module's source belongs to sch-psp-dkms"
    dist = "/usr/lib/python3/dist-packages/"      # the product only, in its rooms (issue 25)
    assert package.problems(p[len(dist):] for p in have if p.startswith(dist + "flowpacer/")) == []
    conffiles = run(["dpkg-deb", "-I", str(fp), "conffiles"], 60, "dpkg-deb -I").stdout.split()
    assert conffiles == ["/etc/flowpacer/rules.yaml"]
    depends = field(fp, "Depends")
    for dep in ("python3-pyroute2", "python3-yaml", "python3-click", "python3-prometheus-client"):
        assert dep in depends, depends
    assert "python3-bpfcc" in field(fp, "Recommends")
    # the headers meta-package, so that a kernel update brings its headers (bcc, DKMS: issue 28)
    for deb in (fp, psp):
        assert field(deb, "Recommends").count("linux-headers-amd64 | ") == 1, field(deb, "Recommends")
    # an upgrade restarts the service once, after the new files are in place (postinst), and
    # never stops it first (prerm stops it on remove only): the classes stay across (issue 28)
    postinst = run(["dpkg-deb", "-I", str(fp), "postinst"], 60, "dpkg-deb -I postinst").stdout
    prerm = run(["dpkg-deb", "-I", str(fp), "prerm"], 60, "dpkg-deb -I prerm").stdout
    assert re.search(r"_dh_action=restart\b", postinst), postinst
    assert re.search(r"\[ \"\$1\" = remove \].*\n\s*deb-systemd-invoke stop '?flowpacer\.service",
                     prerm), prerm

    conf = (ROOT / "flowpacer/kernel/kmod/dkms.conf").read_text()
    version = re.search(r'^PACKAGE_VERSION="?([^"\n]+)"?', conf, re.M).group(1)
    have = contents(psp)
    kmod = ROOT / "flowpacer/kernel/kmod"
    sources = [p.relative_to(kmod).as_posix() for p in kmod.rglob("*")
               if p.is_file() and re.search(r"\.[ch]$|^Kbuild$|^Makefile$|^dkms\.conf$", p.name)
               and p.relative_to(kmod).parts[0] != "sim"]
    assert "sch_psp.c" in sources and "uapi/pkt_sch_psp.h" in sources, sources
    for name in sources:     # every source the module's build may include
        assert f"/usr/src/sch_psp-{version}/{name}" in have, name
    assert not [p for p in have if "/sim/" in p], "the userspace simulator is not the module"
    assert "dkms" in field(psp, "Depends")


# ------------------------------------------------------------------ installed in Debian 13 and 12

@pytest.mark.untimed
def test_apt_resolves_every_dependency_from_the_archive(installed):
    sim, out, _ = installed
    inst = set(re.findall(r"^Inst (\S+)", sim, re.M))
    for pkg in ("flowpacer", "sch-psp-dkms", "python3-pyroute2", "python3-yaml", "python3-click",
                "python3-prometheus-client", "python3-bpfcc", "dkms", "procps"):
        assert pkg in inst, f"{pkg} not in apt's resolution:\n{sim}"
    # from the release itself: none from its backports (in the root's sources for the headers)
    bpo = [line for line in sim.splitlines() if line.startswith("Inst ") and "backports" in line.lower()]
    assert not bpo, bpo
    # with the dependencies in place, installing the two files adds just them
    assert re.search(r"^0 upgraded, 2 newly installed, 0 to remove", out, re.M), out[-3000:]


@pytest.mark.untimed
@pytest.mark.parametrize("which", ["default", "backports"])
def test_dkms_built_sch_psp_without_warnings(installed, chroot, which):
    """For the release's kernel (bookworm 6.1, trixie 6.12) and its backports' (bookworm 6.12,
    trixie 7.3.4, whose headers ask for gcc-14)."""
    kver = chroot.kernels[0 if which == "default" else 1]
    conf = (ROOT / "flowpacer/kernel/kmod/dkms.conf").read_text()
    version = re.search(r'^PACKAGE_VERSION="?([^"\n]+)"?', conf, re.M).group(1)
    st = chroot.sh(f"dkms status -m sch_psp -v {version} -k {kver}").stdout
    assert re.search(rf"^sch_psp/{re.escape(version)}, {re.escape(kver)}, x86_64: installed$", st, re.M), st
    # dkms may compress the module as the kernel's own are (.ko.xz)
    kos = list((chroot.path / f"lib/modules/{kver}/updates/dkms").glob("sch_psp.ko*"))
    assert len(kos) == 1, kos
    ko = f"/lib/modules/{kver}/updates/dkms/{kos[0].name}"
    vermagic = chroot.sh(f"modinfo -F vermagic {ko}").stdout
    assert vermagic.split()[0] == kver, vermagic
    log = (chroot.path / f"var/lib/dkms/sch_psp/{version}/{kver}/x86_64/log/make.log").read_text()
    assert "LD [M]" in log, log
    bad = [line for line in log.splitlines() if re.search(r"warning|error", line, re.I)]
    assert not bad, f"the {kver} build is not clean:\n" + log


@pytest.mark.untimed
@pytest.mark.parametrize("which", ["default", "backports"])
def test_dkms_signs_sch_psp_with_the_mok_key(installed, chroot, which):
    """With a MOK key pair in /var/lib/dkms (mok.key, mok.pub), DKMS signs the module it builds
    for each kernel: modinfo shows the key's subject as signer and its serial as sig_key, so a
    kernel that enforces signatures loads it once that key is enrolled (mokutil --import)."""
    kver = chroot.kernels[0 if which == "default" else 1]
    kos = list((chroot.path / f"lib/modules/{kver}/updates/dkms").glob("sch_psp.ko*"))
    assert len(kos) == 1, kos
    ko = f"/lib/modules/{kver}/updates/dkms/{kos[0].name}"
    signer = chroot.sh(f"modinfo -F signer {ko}").stdout.strip()
    sig_key = chroot.sh(f"modinfo -F sig_key {ko}").stdout.strip()
    print(f"{chroot.release} {kver}: {ko}: signer {signer!r}, sig_key {sig_key}")
    assert signer == MOK_CN, f"{ko}: signer {signer!r}"
    assert sig_key.replace(":", "").upper().lstrip("0") == mok_serial(chroot.path), sig_key


@pytest.mark.untimed
def test_unit_installed_disabled_and_verified(installed, chroot):
    unit = (chroot.path / "lib/systemd/system/flowpacer.service").read_text()
    assert re.search(r"^ExecStart=/usr/bin/flowpacer run --rules /etc/flowpacer/rules.yaml$", unit, re.M)
    assert not [line for line in unit.splitlines() if "/opt/" in line and not line.startswith("#")]
    p = chroot.sh("systemd-analyze verify flowpacer.service 2>&1", check=False)
    assert p.returncode == 0 and "flowpacer" not in p.stdout, p.stdout
    # installed disabled: the example rules must be set for the host first
    p = chroot.sh("systemctl is-enabled flowpacer.service || true")
    assert p.stdout.strip() == "disabled", p.stdout


@pytest.mark.untimed
def test_rules_check_and_man_pages(installed, chroot):
    p = chroot.sh("flowpacer rules check /etc/flowpacer/rules.yaml")
    assert "streaming" in p.stdout and "mirror-sync" in p.stdout, p.stdout
    p = chroot.sh("man -w 8 flowpacer; man -w 5 flowpacer-rules")
    assert p.stdout.split() == ["/usr/share/man/man8/flowpacer.8.gz",
                                "/usr/share/man/man5/flowpacer-rules.5.gz"], p.stdout
    # the daemon's modules import with Debian's libraries (python3-pyroute2 0.7.2, ...)
    chroot.sh("python3 -c 'import flowpacer.daemon.app, flowpacer.kernel.tc, flowpacer.surfaces.metrics; "
              "flowpacer.kernel.tc.register()'")


@pytest.mark.untimed
def test_purge_removes_what_the_packages_added(installed, chroot):
    _, _, before = installed
    # as an admin would: edit the rules (no daemon runs: the file is saved, not reloaded)
    chroot.sh("EDITOR='sed -i s/8mbit/9mbit/' flowpacer rules edit /etc/flowpacer/rules.yaml </dev/null")
    assert (chroot.path / "etc/flowpacer/rules.yaml.bak").exists()
    chroot.sh("apt-get purge -y flowpacer sch-psp-dkms", timeout=300)
    after = chroot.files()
    added = sorted(p for p in after - before if not NOISE.match(p))
    removed = sorted(p for p in before - after if not NOISE.match(p))
    assert not added, f"left after the purge: {added[:50]}"
    assert not removed, f"removed by the purge but there before the install: {removed[:50]}"
    leftovers = sorted(p for p in after if re.search(r"flowpacer|sch_psp|sch-psp", p)
                       and not re.match(r"srv/fptest/|var/lib/dpkg/info/flowpacer-test-|var/cache/", p))
    assert not leftovers, leftovers
