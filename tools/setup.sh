#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine, as root. Safe to run again. What it installs depends
# on what it is asked for, and it says so before it does anything:
#
#   tools/setup.sh build     what `make deb` needs: dpkg-buildpackage, debian/control's
#                            Build-Depends, lintian. Nothing else: no server, no kernel, no venv.
#   tools/setup.sh install   what `make install` (tools/install.sh) needs: python3 with venv and
#                            pip, bcc, DKMS and a compiler for the psp module.
#   tools/setup.sh test      (the default; `make deps`, `make test`, `make demo`) all of the above
#                            and what only the tests and the test VM need: nginx, prometheus,
#                            qemu, iperf3, tshark, mmdebstrap ... (nginx and prometheus start as
#                            services when Debian installs them), bookworm-backports' 6.12 kernel
#                            (image and headers: it becomes the host's default boot kernel),
#                            trixie-backports' 7.3 kernel unpacked for the VM, a trixie root to
#                            build its module, the venv .venv and the headers link bcc needs.
#
#   tools/setup.sh --list MODE      print MODE's Debian packages, one a line (no root needed)
#   tools/setup.sh --dry-run MODE   say what MODE would do and do nothing
#
# tests/test_setup.py checks that no test-only package gets into the build or install lists.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=test
LIST=0
DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    build|install|test) MODE=$1 ;;
    --list) LIST=1 ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument '$1' (build, install, test, --list, --dry-run)" >&2; exit 2 ;;
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
# make test and make demo only: the testbed's servers and traffic tools, the Prometheus the
# metrics tests scrape with (and its promtool), the qemu test VM and its kernels, packet
# captures, the Debian roots of tests/test_deb.py and tests/test_debian13.py
TEST_PKGS=(
  bpfcc-tools linux-headers-amd64 linux-image-amd64 busybox-static qemu-system-x86
  iperf3 ethtool tshark tcpdump curl netcat-openbsd tmux
  prometheus python3-seccomp vim-tiny
  nginx-light apache2-utils nghttp2-client rsync python3-bcrypt
  # harness/xmitstamp.py: a CO-RE BPF object built by clang (14, matching llvm-14 here), loaded
  # through libbpf over ctypes
  clang libbpf1
  # tests/test_deb.py's and tests/test_debian13.py's clean Debian roots
  mmdebstrap
)
case $MODE in
  build) PKGS=("${BUILD_PKGS[@]}") ;;
  install) PKGS=("${INSTALL_PKGS[@]}") ;;
  test) PKGS=("${BUILD_PKGS[@]}" "${INSTALL_PKGS[@]}" "${TEST_PKGS[@]}") ;;
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
if [ "$MODE" != test ]; then
  echo "setup ($MODE): done (no kernel, no server, no venv: those are make test's, tools/setup.sh test)"
  exit 0
fi
if [ "$DRY" = 1 ]; then
  echo "setup (test): would also install bookworm-backports' 6.12 kernel image and headers (the" \
       "default boot kernel then), unpack trixie-backports' 7.3 kernel for the test VM, make a" \
       "trixie root with mmdebstrap to build its module, make the venv .venv and the headers link" \
       "bcc needs"
  exit 0
fi

# Debian 13's kernel, 6.12, from bookworm-backports: the test VM boots it too
# (FLOWPACER_VM_KERNEL=6.12, vm/README.md) and the psp module is built against its headers.
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

# trixie-backports' kernel (7.3) for the test VM (FLOWPACER_VM_KERNEL=7.3), from the Debian
# archive only and without adding trixie to this host's apt sources (a trixie package cannot
# install on bookworm, and the host's upgrades must not see trixie): a private apt state under
# /var/cache/flowpacer fetches the image, base and modules packages, dpkg-deb unpacks them into
# /usr/lib/modules/<version>/ (the image is vmlinuz there, where vm/build.py looks), depmod. Its
# headers need gcc-14, so the module is built for it in a trixie root made by mmdebstrap, where
# apt installs the headers from trixie-backports (vm/kmod.py builds there).
FP_CACHE=/var/cache/flowpacer
TRIXIE_APT=$FP_CACHE/apt-trixie
KBUILD_ROOT=$FP_CACHE/trixie-kbuild
k73_ready() {
  local d v
  for d in /usr/lib/modules/7.3.*+deb13-amd64; do
    v=${d##*/}
    [ -f "$d/vmlinuz" ] && [ -f "$d/modules.dep" ] \
      && [ -f "$KBUILD_ROOT/usr/src/linux-headers-$v/Makefile" ] \
      && [ "$(readlink "$d/build")" = "$KBUILD_ROOT/usr/src/linux-headers-$v" ] && return 0
  done
  return 1
}
if ! k73_ready; then
  t0=$SECONDS
  mkdir -p "$TRIXIE_APT"/etc/preferences.d "$TRIXIE_APT"/state/lists/partial \
           "$TRIXIE_APT"/cache/archives/partial
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main" \
    > "$TRIXIE_APT/etc/sources.list"
  touch "$TRIXIE_APT/state/status"
  tapt=(-o "Dir::Etc::sourcelist=$TRIXIE_APT/etc/sources.list" -o Dir::Etc::sourceparts=-
        -o "Dir::Etc::preferencesparts=$TRIXIE_APT/etc/preferences.d"
        -o "Dir::State=$TRIXIE_APT/state" -o "Dir::State::status=$TRIXIE_APT/state/status"
        -o "Dir::Cache=$TRIXIE_APT/cache" -o APT::Architecture=amd64 -o APT::Sandbox::User=root)
  apt-get "${tapt[@]}" update -qq
  k73=$(apt-cache "${tapt[@]}" search --names-only '^linux-binary-7\.3\.[0-9]+\+deb13-amd64$' \
        | awk '{print $1}' | sed 's/^linux-binary-//' | sort -V | tail -n 1)
  if [ -z "$k73" ]; then
    echo "setup: no linux-binary-7.3.*+deb13-amd64 in trixie-backports" >&2
    exit 1
  fi
  mods=/usr/lib/modules/$k73
  if [ ! -f "$mods/vmlinuz" ] || [ ! -f "$mods/modules.dep" ]; then
    echo "setup: unpacking kernel $k73 (trixie-backports) for the test VM"
    work=$(mktemp -d "$FP_CACHE/unpack.XXXXXX")
    (cd "$work" && apt-get "${tapt[@]}" download -qq \
       "linux-binary-$k73" "linux-base-$k73" "linux-modules-$k73" >/dev/null)
    for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
    rm -rf "$mods"
    mv "$work/root/usr/lib/modules/$k73" "$mods"
    rm -rf "$work"
    depmod "$k73"
  fi
  if [ ! -f "$KBUILD_ROOT/usr/src/linux-headers-$k73/Makefile" ]; then
    echo "setup: making $KBUILD_ROOT (trixie, gcc-14, linux-headers-$k73) to build modules for it"
    rm -rf "$KBUILD_ROOT.new"
    mmdebstrap --quiet --variant=minbase \
      --include="gcc-14,make,libc6-dev,libelf-dev,dwarves,kmod,linux-headers-$k73" \
      trixie "$KBUILD_ROOT.new" \
      "deb http://deb.debian.org/debian trixie main" \
      "deb http://deb.debian.org/debian trixie-backports main"
    mkdir -p "$KBUILD_ROOT.new/mnt/kmod"     # vm/kmod.py binds the module's sources here
    rm -rf "$KBUILD_ROOT"
    mv "$KBUILD_ROOT.new" "$KBUILD_ROOT"
  fi
  # bcc in the guest (tracer, first-byte hooks) compiles against /lib/modules/<version>/build
  # and source: the root's headers (bcc reads them, it does not run their Makefile)
  ln -sfn "$KBUILD_ROOT/usr/src/linux-headers-$k73" "$mods/build"
  ln -sfn "$KBUILD_ROOT/usr/src/linux-headers-${k73%-amd64}-common" "$mods/source"
  echo "setup: kernel $k73 ready in $((SECONDS - t0)) s"
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
