#!/usr/bin/env bash
# Idempotent set-up for a Debian 13 (trixie) or Debian 12 (bookworm) machine, as root. Safe to
# run again. What it installs depends on what it is asked for, and it says so before it does
# anything:
#
#   tools/setup.sh build     what `make deb` needs: dpkg-buildpackage, debian/control's
#                            Build-Depends, lintian. Nothing else: no server, no kernel, no venv.
#   tools/setup.sh install   what `make install` (tools/install.sh) needs: python3 with venv and
#                            pip, bcc, DKMS and a compiler for the psp module.
#   tools/setup.sh demo      (`make demo`, `make check`) install's and what the demo and the
#                            fast tests need: the release's kernel headers for bcc, clang, the
#                            editors of `rules edit`, htpasswd ...; the venv .venv and the
#                            headers link bcc needs. No server, no VM, no kernel.
#   tools/setup.sh test      (the default; `make deps`, `make test`) all of the above and what
#                            only the tests and the test VM need: nginx, prometheus, qemu,
#                            iperf3, tshark, mmdebstrap ... (nginx and prometheus start as
#                            services when Debian installs them) and the VM's kernels: on Debian
#                            12 bookworm-backports' 6.12 (image and headers: it becomes the
#                            host's default boot kernel); on Debian 13 bookworm's 6.1 unpacked
#                            with a bookworm root to build its module; on both trixie-backports'
#                            7.3 unpacked with a trixie root to build its module.
#   tools/setup.sh kernels   the test VM's kernels alone, as `test` sets them up (and mmdebstrap).
#
#   tools/setup.sh --list MODE      print MODE's Debian packages, one a line (no root needed)
#   tools/setup.sh --dry-run MODE   say what MODE would do and do nothing
#
# tests/test_setup.py checks that no test-only package gets into the build or install lists;
# tests/test_debian13.py runs `demo` in a clean trixie root.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=test
LIST=0
DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    build|install|demo|test|kernels) MODE=$1 ;;
    --list) LIST=1 ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument '$1' (build, install, demo, test, kernels, --list, --dry-run)" >&2; exit 2 ;;
  esac
  shift
done

# make deb: dpkg-buildpackage (build-essential, dpkg-dev), debian/control's Build-Depends
# (debhelper, pybuild's pyproject build, dh-dkms), lintian; git lists the checkout's files
BUILD_PKGS=(
  build-essential dpkg-dev git
  debhelper dh-python dh-dkms pybuild-plugin-pyproject python3-all python3-setuptools lintian
)
# make install (tools/install.sh): a venv of Debian's python3 that imports bcc, DKMS and a
# compiler for the psp module, the kernel tools the daemon runs
INSTALL_PKGS=(
  python3 python3-venv python3-pip python3-bpfcc
  build-essential dkms kmod iproute2 systemd
)
# make demo and make check: the headers of the release's kernel (bcc compiles the tracer
# against them where the running kernel has none), clang and libbpf (harness/xmitstamp.py: a
# CO-RE BPF object built by clang, loaded through libbpf over ctypes), make, the editors and tmux
# of `rules edit`'s tests, htpasswd and bcrypt of the metrics endpoint's basic auth
DEMO_PKGS=(
  linux-headers-amd64 clang libbpf1 make procps vim-tiny tmux apache2-utils python3-bcrypt openssl
)
# make test only: the testbed's servers and traffic tools, the Prometheus the
# metrics tests scrape with (and its promtool), the qemu test VM and its kernels, packet
# captures, the Debian roots of tests/test_deb.py and tests/test_debian13.py
TEST_PKGS=(
  bpfcc-tools linux-image-amd64 busybox-static qemu-system-x86
  iperf3 ethtool tshark tcpdump curl netcat-openbsd
  prometheus python3-seccomp
  nginx-light nghttp2-client rsync
  # tests/test_deb.py's and tests/test_debian13.py's clean Debian roots
  mmdebstrap
  # the flowpacer package's dependencies from Debian: tests/test_deb.py's VM case boots this
  # host's root and installs the two packages there (byte-compiling these under TCG took
  # minutes); the venv's own pyroute2 ... come first on the venv's path
  python3-click python3-prometheus-client python3-pyroute2 python3-yaml
)
case $MODE in
  build) PKGS=("${BUILD_PKGS[@]}") ;;
  install) PKGS=("${INSTALL_PKGS[@]}") ;;
  demo) PKGS=("${INSTALL_PKGS[@]}" "${DEMO_PKGS[@]}") ;;
  kernels) PKGS=(mmdebstrap kmod) ;;
  test) PKGS=("${BUILD_PKGS[@]}" "${INSTALL_PKGS[@]}" "${DEMO_PKGS[@]}" "${TEST_PKGS[@]}") ;;
esac
mapfile -t PKGS < <(printf '%s\n' "${PKGS[@]}" | sort -u)
if [ "$LIST" = 1 ]; then
  printf '%s\n' "${PKGS[@]}"
  exit 0
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
echo "setup ($MODE): Debian packages: ${PKGS[*]}"
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup ($MODE): all installed already"
elif [ "$DRY" = 1 ]; then
  echo "setup ($MODE): would install: ${missing[*]}"
else
  [ "$(id -u)" -eq 0 ] || { echo "setup: installing packages needs root (missing: ${missing[*]})" >&2; exit 1; }
  echo "setup ($MODE): installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # tshark asks whether non-root may capture: answer once, non-interactively.
  if [ "$MODE" = test ]; then
    echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ "$MODE" = build ] || [ "$MODE" = install ]; then
  echo "setup ($MODE): done (no kernel, no server, no venv: those are make test's, tools/setup.sh test)"
  exit 0
fi
RELEASE=$( (. /etc/os-release && echo "${VERSION_CODENAME:-}") 2>/dev/null || true)
VM_KERNELS=0
case $MODE in test|kernels) VM_KERNELS=1 ;; esac
if [ "$VM_KERNELS" = 1 ] && [ "$RELEASE" != bookworm ] && [ "$RELEASE" != trixie ]; then
  echo "setup ($MODE): the test VM's kernels are set up on Debian 12 (bookworm) or 13 (trixie)," \
       "not on '${RELEASE:-unknown}'" >&2
  exit 1
fi
if [ "$DRY" = 1 ]; then
  case $VM_KERNELS-$RELEASE in
    1-bookworm)
      echo "setup ($MODE): would also install bookworm-backports' 6.12 kernel image and headers" \
           "(the default boot kernel then), unpack trixie-backports' 7.3 kernel for the test VM," \
           "make a trixie root with mmdebstrap to build its module" ;;
    1-trixie)
      echo "setup ($MODE): would also unpack bookworm's 6.1 kernel for the test VM and make a" \
           "bookworm root with mmdebstrap to build its module, unpack trixie-backports' 7.3 kernel" \
           "for the test VM and make a trixie root with mmdebstrap to build its module (6.12 is" \
           "trixie's own: linux-image-amd64)" ;;
  esac
  [ "$MODE" = kernels ] || echo "setup ($MODE): would also make the venv .venv and the headers link bcc needs"
  exit 0
fi

# The test VM's kernels (vm/README.md): Debian 12's 6.1 (the default), Debian 13's 6.12
# (FLOWPACER_VM_KERNEL=6.12) and trixie-backports' 7.3 (FLOWPACER_VM_KERNEL=7.3, and booted by
# make test for the module, fuzz and daemon tests), each with headers to build the psp module
# for it. The release's own kernel comes with linux-image-amd64 and linux-headers-amd64 (TEST_PKGS);
# on Debian 12, 6.12 comes from bookworm-backports, installed; every other one is fetched from
# the Debian archive by a private apt state under /var/cache/flowpacer (the host's own apt
# sources never see another release: its packages cannot install here, and the host's upgrades
# must not see them) and unpacked into /usr/lib/modules/<version>/ (the image as vmlinuz there,
# where vm/build.py looks), with a root of that release made by mmdebstrap to build modules for
# it with its own compiler (vm/kmod.py builds there; bcc reads the headers through the build
# link).
FP_CACHE=/var/cache/flowpacer

# private_apt NAME SOURCES-LINE...: sets TAPT to apt options for a private state
# $FP_CACHE/apt-NAME with these sources, updated
private_apt() {
  local d=$FP_CACHE/apt-$1
  shift
  mkdir -p "$d"/etc/preferences.d "$d"/state/lists/partial "$d"/cache/archives/partial
  printf '%s\n' "$@" > "$d/etc/sources.list"
  touch "$d/state/status"
  TAPT=(-o "Dir::Etc::sourcelist=$d/etc/sources.list" -o Dir::Etc::sourceparts=-
        -o "Dir::Etc::preferencesparts=$d/etc/preferences.d"
        -o "Dir::State=$d/state" -o "Dir::State::status=$d/state/status"
        -o "Dir::Cache=$d/cache" -o APT::Architecture=amd64 -o APT::Sandbox::User=root)
  apt-get "${TAPT[@]}" update -qq
}

# foreign_kernel SERIES RELEASE SUITE IMAGE-REGEX COMPILER PACKAGE-PATTERN...:
# kernel SERIES of another release, unpacked for the VM, and a root of RELEASE (SUITE's
# sources) with its headers and COMPILER to build modules for it. The newest version whose
# package names match IMAGE-REGEX (with the version as its one group) is taken; each
# PACKAGE-PATTERN, with the version for %s, is a package to unpack.
foreign_kernel() {
  local series=$1 release=$2 suite=$3 regex=$4 cc=$5
  shift 5
  local kroot=$FP_CACHE/$release-kbuild d v
  for d in /usr/lib/modules/"$series".*; do
    v=${d##*/}
    [ -f "$d/vmlinuz" ] && [ -f "$d/modules.dep" ] \
      && [ -f "$kroot/usr/src/linux-headers-$v/Makefile" ] \
      && [ "$(readlink "$d/build")" = "$kroot/usr/src/linux-headers-$v" ] && return 0
  done
  local t0=$SECONDS line="deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian"
  private_apt "$suite" "$line $suite main"
  v=$(apt-cache "${TAPT[@]}" search --names-only "$regex" | awk '{print $1}' \
      | sed -E "s/$regex/\\1/" | sort -V | tail -n 1)
  if [ -z "$v" ]; then
    echo "setup: no kernel $series ($regex) in $suite" >&2
    exit 1
  fi
  local mods=/usr/lib/modules/$v pkgs=() p
  for p in "$@"; do pkgs+=("$(printf "$p" "$v")"); done
  if [ ! -f "$mods/vmlinuz" ] || [ ! -f "$mods/modules.dep" ]; then
    echo "setup: unpacking kernel $v ($suite) for the test VM"
    local work
    work=$(mktemp -d "$FP_CACHE/unpack.XXXXXX")
    (cd "$work" && apt-get "${TAPT[@]}" download -qq "${pkgs[@]}" >/dev/null)
    for p in "$work"/*.deb; do dpkg-deb -x "$p" "$work/root"; done
    rm -rf "$mods"
    mkdir -p /usr/lib/modules
    if [ -d "$work/root/usr/lib/modules/$v" ]; then
      mv "$work/root/usr/lib/modules/$v" "$mods"
    else       # bookworm's packages, before the /usr merge of their paths
      mv "$work/root/lib/modules/$v" "$mods"
    fi
    # bookworm's image packages put it in /boot
    [ -f "$mods/vmlinuz" ] || mv "$work/root/boot/vmlinuz-$v" "$mods/vmlinuz"
    rm -rf "$work"
    depmod "$v"
  fi
  if [ ! -f "$kroot/usr/src/linux-headers-$v/Makefile" ]; then
    echo "setup: making $kroot ($release, $cc, linux-headers-$v) to build modules for it"
    rm -rf "$kroot.new"
    local srcs=("$line $release main")
    [ "$suite" != "$release" ] && srcs+=("$line $suite main")
    mmdebstrap --quiet --variant=minbase \
      --include="$cc,make,libc6-dev,libelf-dev,dwarves,kmod,linux-headers-$v" \
      "$release" "$kroot.new" "${srcs[@]}"
    mkdir -p "$kroot.new/mnt/kmod"     # vm/kmod.py binds the module's sources here
    rm -rf "$kroot"
    mv "$kroot.new" "$kroot"
  fi
  # bcc in the guest (tracer, first-byte hooks) compiles against /lib/modules/<version>/build
  # and source: the root's headers (bcc reads them, it does not run their Makefile)
  ln -sfn "$kroot/usr/src/linux-headers-$v" "$mods/build"
  ln -sfn "$kroot/usr/src/linux-headers-${v%-amd64}-common" "$mods/source"
  echo "setup: kernel $v ready in $((SECONDS - t0)) s"
}

if [ "$VM_KERNELS" = 1 ]; then
case $RELEASE in
  bookworm)
    # Debian 13's kernel, 6.12, from bookworm-backports, installed (it becomes this host's
    # default boot kernel): the psp module is built against its headers with the host's gcc
    if ! ls /boot/vmlinuz-6.12.*+deb12-amd64 >/dev/null 2>&1 \
       || ! ls -d /usr/src/linux-headers-6.12.*+deb12-amd64 >/dev/null 2>&1; then
      if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
        cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
      fi
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      # the newest 6.12 whose signed image and headers are both in the archive
      k612=$(apt-cache search --names-only '^linux-headers-6\.12\.[0-9]+\+deb12-amd64$' \
             | awk '{print $1}' | sed 's/^linux-headers-//' | sort -V \
             | while read -r v; do apt-cache show "linux-image-$v" >/dev/null 2>&1 && echo "$v"; done \
             | tail -n 1)
      if [ -z "$k612" ]; then
        echo "setup: no linux-image/headers 6.12.*+deb12-amd64 in bookworm-backports" >&2
        exit 1
      fi
      echo "setup: installing kernel $k612 (bookworm-backports) for the test VM; it becomes this" \
           "host's default boot kernel"
      apt-get install -y -qq --no-install-recommends -t bookworm-backports \
        "linux-image-$k612" "linux-headers-$k612" >/dev/null
    fi
    ;;
  trixie)
    # Debian 12's kernel, 6.1, from bookworm: the image package holds the modules; its headers
    # need bookworm's gcc-12
    foreign_kernel 6.1 bookworm bookworm '^linux-image-(6\.1\.0-[0-9]+-amd64)$' gcc-12 \
      'linux-image-%s'
    ;;
esac
# trixie-backports' 7.3 (on either release): image, base and modules packages; headers with gcc-14
foreign_kernel 7.3 trixie trixie-backports '^linux-binary-(7\.3\.[0-9]+\+deb13-amd64)$' gcc-14 \
  'linux-binary-%s' 'linux-base-%s' 'linux-modules-%s'
fi
if [ "$MODE" = kernels ]; then
  echo "setup (kernels): done"
  exit 0
fi

# The venv uses Debian's python3 so that bcc (python3-bpfcc) imports.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c 'import flowpacer, pyroute2, yaml, click, pytest, hypothesis, prometheus_client, matplotlib, numpy, bcrypt' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' prometheus-client matplotlib numpy
  touch .venv/.installed
fi

# bcc compiles against /lib/modules/$(uname -r)/build. Where the running kernel has no headers
# package (this project's VMs), point it at the headers of Debian 12's own kernel, the ones
# linux-headers-amd64 depends on: tracepoint programs only need the common structures, and
# Debian 12's bcc (0.26) cannot compile against the 6.12 headers installed above for the test VM
# (include/linux/bpf.h: incomplete struct bpf_wq), so "the newest headers" would leave the host
# without its tracer. A link of ours to other headers is pointed back.
kver=$(uname -r)
moddir=/lib/modules/$kver
hdr=$(dpkg-query -W -f='${Depends}' linux-headers-amd64 2>/dev/null \
      | grep -o 'linux-headers-[^ ,]*-amd64' | head -n 1)
hdr=${hdr:+/usr/src/$hdr}
if [ -z "$hdr" ] || [ ! -d "$hdr" ]; then
  hdr=$(ls -d /usr/src/linux-headers-6.1.*-amd64 2>/dev/null | sort -V | tail -n 1)
fi
common=${hdr%-amd64}-common
if [ -n "$hdr" ] && [ -d "$common" ] && [ ! -d "/usr/src/linux-headers-$kver" ]; then
  cur=$(readlink "$moddir/build" 2>/dev/null || true)
  if [ ! -e "$moddir/build/include" ] || { [ -L "$moddir/build" ] && [ "${cur#/usr/src/linux-headers-}" != "$cur" ] && [ "$cur" != "$hdr" ]; }; then
    mkdir -p "$moddir"
    ln -sfn "$hdr" "$moddir/build"
    ln -sfn "$common" "$moddir/source"
    echo "setup: $moddir/build -> $hdr (no headers package for $kver)"
  fi
fi
if ! mountpoint -q /sys/kernel/tracing 2>/dev/null; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
fi
exit 0
