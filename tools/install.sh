#!/usr/bin/env bash
# Install flowpacer from this checkout as a systemd service. Idempotent: run it again to
# upgrade; an existing rules file is never overwritten. Run as root.
#
#   tools/install.sh                       venv /opt/flowpacer, /etc/flowpacer/rules.yaml,
#                                          /etc/systemd/system/flowpacer.service, sch_psp by DKMS
#
# What it does:
#   1. a venv at $PREFIX made with --system-site-packages (Debian's python3-bpfcc must import)
#   2. pip install of this checkout into it (from a clean copy: the checkout is not written to)
#   3. the unit to $UNITDIR (paths rewritten when PREFIX/CONFDIR are not the defaults) and
#      `systemctl daemon-reload` when systemd runs and the unit changed
#   4. rules/example.yaml to $CONFDIR/rules.yaml (root:root 0644) if there is none
#   5. the psp qdisc module through DKMS when flowpacer/kernel/kmod/dkms.conf exists (add, build,
#      install); a failure there is reported, not fatal: the daemon then uses htb
#
# Overrides (environment):
#   DESTDIR=DIR     stage everything under DIR (a venv is not relocatable: a staged venv only
#                   works at DIR$PREFIX; DKMS and systemctl are skipped)
#   PREFIX=/opt/flowpacer  CONFDIR=/etc/flowpacer  UNITDIR=/etc/systemd/system
#   DKMS=auto|yes|no       auto: when dkms is installed and DESTDIR is empty
#   DKMS_CMD=dkms  DKMS_SRCDIR=/usr/src    SYSTEMCTL=auto|no    PYTHON=/usr/bin/python3
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DESTDIR=${DESTDIR:-}
PREFIX=${PREFIX:-/opt/flowpacer}
CONFDIR=${CONFDIR:-/etc/flowpacer}
UNITDIR=${UNITDIR:-/etc/systemd/system}
DKMS=${DKMS:-auto}
DKMS_CMD=${DKMS_CMD:-dkms}
DKMS_SRCDIR=${DKMS_SRCDIR:-/usr/src}
SYSTEMCTL=${SYSTEMCTL:-auto}
PYTHON=${PYTHON:-/usr/bin/python3}

say()  { printf 'install: %s\n' "$*"; }
warn() { printf 'install: warning: %s\n' "$*" >&2; }
die()  { printf 'install: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run me as root (files are installed root:root)"
for v in PREFIX CONFDIR UNITDIR DKMS_SRCDIR; do
  case ${!v} in /*) ;; *) die "$v must be an absolute path, not '${!v}'" ;; esac
done
case $DESTDIR in ""|/*) ;; *) die "DESTDIR must be an absolute path, not '$DESTDIR'" ;; esac
case $DKMS in auto|yes|no) ;; *) die "DKMS must be auto, yes or no, not '$DKMS'" ;; esac
[ -x "$PYTHON" ] || die "$PYTHON not found (apt-get install python3 python3-venv)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || die "python3 cannot make venvs (apt-get install python3-venv)"
"$PYTHON" -c 'import bcc' 2>/dev/null || warn "python3-bpfcc is not installed: the daemon will find flows by sock_diag polling only (apt-get install python3-bpfcc linux-headers-\$(uname -r))"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The files of the checkout that belong to it (not the venv, build products or caches).
list_sources() {
  if command -v git >/dev/null && git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$SRC" ls-files -z --cached --others --exclude-standard -- "$@"
  else
    (cd "$SRC" && find "${@:-.}" \( -name .git -o -name .venv -o -name build -o -name '*.egg-info' \
        -o -name __pycache__ -o -name .pytest_cache -o -name .hypothesis -o -path ./vm/out \) -prune \
        -o -type f ! -name '*.o' ! -name '*.ko' ! -name '*.pyc' -print0)
  fi
}
copy_sources() {   # DEST [PATHS...]: the listed files of the checkout, paths kept
  local dest=$1; shift
  mkdir -p "$dest"
  list_sources "$@" | (cd "$SRC" && tar --null -T - -cf -) | tar -C "$dest" -xf -
}

# ------------------------------------------------------------------ 1. venv
venv=$DESTDIR$PREFIX
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
  die "$venv exists and is not a venv: not touching it"
fi
if [ -f "$venv/pyvenv.cfg" ] && "$venv/bin/python" -c 'import sys' 2>/dev/null \
   && grep -qx 'include-system-site-packages = true' "$venv/pyvenv.cfg"; then
  say "venv $venv: kept"
else
  [ -f "$venv/pyvenv.cfg" ] && say "venv $venv: broken or without system site packages, making it anew"
  rm -rf "$venv"
  "$PYTHON" -m venv --system-site-packages "$venv"
  say "venv $venv: made (--system-site-packages)"
fi

# ------------------------------------------------------------------ 2. the package
copy_sources "$work/src"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
# Build with the venv's own setuptools when it is recent enough (no download for the build);
# dependencies already installed as Debian packages (python3-click, python3-pyroute2, ...) are
# used as they are, so with those `PIP_NO_INDEX=1 tools/install.sh` needs no network at all.
build=()
if "$venv/bin/python" -c 'import sys, setuptools, wheel; sys.exit(int(setuptools.__version__.split(".")[0]) < 61)' 2>/dev/null; then
  build=(--no-build-isolation)
fi
"${pip[@]}" install --quiet --no-warn-script-location "${build[@]}" "$work/src" \
  || die "pip install of $SRC into $venv failed"
# the same version number may already be installed: make sure this checkout's code is the one
"${pip[@]}" install --quiet --no-warn-script-location "${build[@]}" --no-deps --force-reinstall "$work/src" \
  || die "pip install of $SRC into $venv failed"
"$venv/bin/flowpacer" --help >/dev/null || die "$venv/bin/flowpacer does not run"
say "flowpacer $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("flowpacer"))') installed in $venv"

# ------------------------------------------------------------------ 3. the unit
unit_src=$SRC/systemd/flowpacer.service
unit_dst=$DESTDIR$UNITDIR/flowpacer.service
sed -e "s#/opt/flowpacer/#$PREFIX/#g" -e "s#/etc/flowpacer/#$CONFDIR/#g" "$unit_src" > "$work/flowpacer.service"
install -d -m 0755 -o root -g root "$DESTDIR$UNITDIR"
if [ -f "$unit_dst" ] && cmp -s "$work/flowpacer.service" "$unit_dst"; then
  say "unit $unit_dst: unchanged"
else
  install -m 0644 -o root -g root "$work/flowpacer.service" "$unit_dst"
  say "unit $unit_dst: installed"
  if [ -z "$DESTDIR" ] && [ "$SYSTEMCTL" = auto ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload && say "systemctl daemon-reload: done" || warn "systemctl daemon-reload failed"
  fi
fi

# ------------------------------------------------------------------ 4. the rules
rules=$DESTDIR$CONFDIR/rules.yaml
install -d -m 0755 -o root -g root "$DESTDIR$CONFDIR"
if [ -e "$rules" ]; then
  say "rules $rules: kept as they are"
else
  install -m 0644 -o root -g root "$SRC/rules/example.yaml" "$rules"
  say "rules $rules: the example installed: set its interface and rules (flowpacer rules edit $CONFDIR/rules.yaml)"
fi
if ! "$venv/bin/flowpacer" rules check "$rules" >/dev/null 2>"$work/check"; then
  warn "$rules does not validate yet:"
  sed 's/^/    /' "$work/check" >&2
fi

# ------------------------------------------------------------------ 5. the psp module (DKMS)
kmod=$SRC/flowpacer/kernel/kmod
if [ ! -f "$kmod/dkms.conf" ]; then
  say "psp module: no flowpacer/kernel/kmod/dkms.conf here, skipped (the daemon uses htb)"
elif [ "$DKMS" = no ] || { [ "$DKMS" = auto ] && [ -n "$DESTDIR" ]; }; then
  say "psp module: DKMS skipped (DKMS=$DKMS${DESTDIR:+, DESTDIR set})"
elif ! command -v "$DKMS_CMD" >/dev/null; then
  if [ "$DKMS" = yes ]; then
    warn "psp module: $DKMS_CMD not found: not installed (apt-get install dkms linux-headers-\$(uname -r))"
  else
    say "psp module: dkms is not installed, skipped (apt-get install dkms linux-headers-\$(uname -r); the daemon uses htb)"
  fi
else
  conf_value() { sed -n "s/^$1=\"\{0,1\}\([^\"]*\)\"\{0,1\}[[:space:]]*$/\1/p" "$kmod/dkms.conf" | head -n 1; }
  name=$(conf_value PACKAGE_NAME)
  version=$(conf_value PACKAGE_VERSION)
  if [ -z "$name" ] || [ -z "$version" ]; then
    warn "psp module: cannot read PACKAGE_NAME/PACKAGE_VERSION from $kmod/dkms.conf: skipped"
  else
    dst=$DESTDIR$DKMS_SRCDIR/$name-$version
    copy_sources "$work/kmod" flowpacer/kernel/kmod
    # a fresh source tree each time: dkms builds what is in it
    if "$DKMS_CMD" status -m "$name" -v "$version" 2>/dev/null | grep -q .; then
      "$DKMS_CMD" remove -m "$name" -v "$version" --all >/dev/null 2>&1 \
        || warn "psp module: dkms remove $name/$version failed"
    fi
    rm -rf "$dst"
    mkdir -p "$(dirname "$dst")"
    cp -r "$work/kmod/flowpacer/kernel/kmod" "$dst"
    ok=1
    for step in add build install; do
      if ! "$DKMS_CMD" "$step" -m "$name" -v "$version" >"$work/dkms.log" 2>&1; then
        warn "psp module: dkms $step $name/$version failed (not fatal: the daemon uses htb):"
        tail -n 15 "$work/dkms.log" | sed 's/^/    /' >&2
        ok=0
        break
      fi
    done
    if [ $ok = 1 ]; then say "psp module: $name/$version built and installed by DKMS"; fi
  fi
fi

say "done. Next: edit $CONFDIR/rules.yaml (flowpacer rules edit), then: systemctl enable --now flowpacer"
