"""``flowpacer rules edit``: edit the rules file the way visudo / ``crontab -e`` do.

1. Which file: the one given, else the running daemon's (its status answer's ``rules``), else
   ``/etc/flowpacer/rules.yaml``.
2. ``FILE.lock`` is locked (``flock``, non-blocking) for the whole session, so that two editors
   of the same file cannot both win; the loser is told which pid holds it.
3. The file is copied into a private temporary directory (0700, the copy 0600) and
   ``$VISUAL`` / ``$EDITOR`` (split like a shell would, never run through one), else ``editor``,
   else ``vi``, edits the copy.
4. The copy is validated with the rules loader under the REAL file's name, so every problem reads
   ``FILE:LINE:COL: ...``. On problems: "(e)dit again, (d)iscard?" on a terminal; without one the
   edit is discarded (exit 2).
5. Before anything is replaced the file is read again: if it changed since it was copied (another
   writer, by content hash), was deleted or became unreadable, nothing is replaced and the user's
   version stays where it is (the message says where).
6. The file is replaced atomically with its owner and mode: the previous version is written to
   ``FILE.bak``, the new one to a temporary file in the same directory, each fsynced, renamed over
   the old name, and the directory fsynced.
7. If the running daemon uses this file it is asked to reload, and what the reload did is shown.

Exit status: 0 saved (or nothing to do), 1 a one-line failure (nothing replaced unless it says
so), 2 invalid rules discarded. ``edit(file, socket_path, ui)`` is the entry point; ``ui`` is the
only thing that talks to the terminal (``TerminalUI`` is the CLI's).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Protocol

from flowpacer.surfaces import control
from flowpacer.policy import rules as loader
from flowpacer.errors import FlowpacerError, RulesError
from flowpacer.model import ReloadResult
from flowpacer.text import printable
from flowpacer.surfaces.view import parse_reload

log = logging.getLogger(__name__)

DEFAULT_RULES = "/etc/flowpacer/rules.yaml"
STATUS_TIMEOUT = 5.0          # seconds to wait for the daemon's status (which file it uses)
RELOAD_TIMEOUT = 60.0         # a reload may switch backends


class UI(Protocol):
    def info(self, msg: str) -> None: ...          # progress and results (stdout)
    def error(self, msg: str) -> None: ...         # problems (stderr)
    def ask(self, prompt: str) -> Optional[str]: ...  # None: no terminal to ask on


class TerminalUI:
    """The CLI's side: stdout for results, stderr for problems, questions only on a tty."""

    def info(self, msg: str) -> None:
        import click
        click.echo(msg)

    def error(self, msg: str) -> None:
        import click
        click.echo(msg, err=True)

    def ask(self, prompt: str) -> Optional[str]:
        import click
        if not sys.stdin.isatty():
            return None
        click.echo(prompt, nl=False)
        try:
            line = sys.stdin.readline()      # Ctrl-C: KeyboardInterrupt, the session handles it
        except OSError:
            return None
        return line.strip() if line else "d"    # end of input: discard


class EditError(FlowpacerError):
    """A one-line reason to stop; ``code`` is the exit status."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


@dataclass
class _Original:
    data: bytes
    digest: str
    uid: int
    gid: int
    mode: int                 # permission bits (st_mode & 0o7777)


@dataclass
class _Daemon:
    """What the running daemon said about itself (None fields: no daemon answers)."""
    rules: Optional[str] = None      # its rules file, absolute
    error: str = ""                  # why no daemon answered


# ------------------------------------------------------------------ helpers

def editor_argv(environ=None) -> List[str]:
    """The editor command: $VISUAL, else $EDITOR (split like a shell would split it, without
    running one), else ``editor``, else ``vi``."""
    env = os.environ if environ is None else environ
    for var in ("VISUAL", "EDITOR"):
        value = env.get(var, "")
        if not value.strip():
            continue
        try:
            argv = shlex.split(value)
        except ValueError as e:
            raise EditError(f"${var} cannot be split into a command ({e}): {printable(value)}") from None
        if argv:
            return argv
    for name in ("editor", "vi"):
        if shutil.which(name):
            return [name]
    raise EditError("no editor found: set $VISUAL or $EDITOR")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _peer_pid(sock_path: str) -> Optional[int]:
    """The pid of the process serving the control socket (SO_PEERCRED), None if unknown."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(STATUS_TIMEOUT)
    try:
        s.connect(sock_path)
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        s.sendall(b'{"cmd": "ping"}\n')
        s.shutdown(socket.SHUT_WR)
        while s.recv(4096):
            pass
        return pid if pid > 0 else None
    except OSError:
        return None
    finally:
        s.close()


def ask_daemon(sock_path: str) -> _Daemon:
    """Which rules file the daemon on ``sock_path`` uses (made absolute with its working
    directory when it was started with a relative path)."""
    try:
        st = control.call(sock_path, {"cmd": "status"}, timeout=STATUS_TIMEOUT)
    except FlowpacerError as e:
        return _Daemon(error=str(e))
    path = st.get("rules")
    if not isinstance(path, str) or not path:
        return _Daemon(error="the daemon did not say which rules file it uses")
    if not os.path.isabs(path):
        pid = _peer_pid(sock_path)
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd") if pid else None
        except OSError:
            cwd = None
        if cwd is None:
            return _Daemon(error=f"the daemon uses the relative path {printable(path)} and its "
                                 f"working directory is unknown")
        path = os.path.join(cwd, path)
    return _Daemon(rules=os.path.normpath(path))


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, uid: int, gid: int, mode: int) -> None:
    """Replace ``path`` by ``data`` with the given owner and mode: a temporary file in the same
    directory, fsynced, renamed over ``path``. The directory is not fsynced here."""
    d, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=d or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            st = os.fstat(f.fileno())      # (a set-gid directory gives its group)
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.fchown(f.fileno(), uid, gid)
            os.fchmod(f.fileno(), mode)          # after chown, which may clear set-id bits
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------ the session

class Session:
    def __init__(self, file: Optional[str], socket_path: str, ui: UI, environ=None):
        self.file = file
        self.socket_path = socket_path
        self.ui = ui
        self.environ = os.environ if environ is None else environ
        self.display = ""            # the name shown in messages (as given or as found)
        self.real = ""               # the file actually replaced (symlinks resolved)
        self.tmpdir: Optional[str] = None
        self.copy: Optional[str] = None
        self.keep = False            # leave the user's copy where it is
        self._lock_fd: Optional[int] = None
        self._orig_digest: Optional[str] = None

    # ---------------------------------------------------------------- driver
    def run(self) -> int:
        try:
            return self._run()
        except EditError as e:
            self.ui.error(f"flowpacer: {printable(e)}")
            return e.code
        except KeyboardInterrupt:
            self.ui.error("")
            self.ui.error("flowpacer: interrupted: nothing saved" + self._kept())
            return 130
        except OSError as e:      # anything unexpected from the file system: one line
            where = f" ({printable(e.filename)})" if e.filename else ""
            self.ui.error(f"flowpacer: {printable(e.strerror or e)}{where}: nothing saved" + self._kept())
            return 1
        finally:
            self._cleanup()

    def _kept(self) -> str:
        if self.copy and os.path.exists(self.copy) and self._copy_differs():
            self.keep = True
            return f"; your version is kept in {printable(self.copy)}"
        return ""

    def _copy_differs(self) -> bool:
        try:
            with open(self.copy, "rb") as f:
                return _digest(f.read()) != self._orig_digest
        except OSError:
            return False

    def _cleanup(self) -> None:
        if self.tmpdir and not self.keep:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)          # releases the flock
            self._lock_fd = None

    def _run(self) -> int:
        daemon = ask_daemon(self.socket_path)
        if self.file:
            self.display = self.file
        elif daemon.rules:
            self.display = daemon.rules
        else:
            self.display = DEFAULT_RULES
            self.ui.info(f"no daemon answers on {printable(self.socket_path)}: editing {DEFAULT_RULES}")
        self.real = os.path.realpath(self.display)
        try:
            os.stat(self.real)
        except OSError as e:
            hint = " (give FILE, or create it from rules/example.yaml)" \
                if e.errno == errno.ENOENT and not self.file else ""
            raise EditError(f"cannot read {printable(self.display)}: {e.strerror}{hint}") from None
        self._lock()
        orig = self._read_original()
        self._orig_digest = orig.digest
        self._make_copy(orig)
        edited = self._edit_until_valid(orig)
        if edited is None:
            return 0
        self._check_unchanged(orig)
        self._replace(orig, edited)
        return self._reload(daemon)

    # ------------------------------------------------------------------ lock
    def _lock(self) -> None:
        path = self.real + ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise EditError(f"cannot create the lock file {printable(path)}: {e.strerror} "
                            f"(editing needs write access to {printable(os.path.dirname(path))})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EditError(f"cannot lock {printable(path)}: {e.strerror}") from None
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise EditError(f"{printable(self.display)} is being edited by {who} "
                            f"(lock {printable(path)})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    # ------------------------------------------------------------ the copy
    def _read_original(self) -> _Original:
        try:
            fd = os.open(self.real, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise EditError(f"cannot read {printable(self.display)}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise EditError(f"{printable(self.display)} is not a regular file")
            data = f.read()
        return _Original(data, _digest(data), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))

    def _make_copy(self, orig: _Original) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="flowpacer-edit.")       # mode 0700
        base = os.path.basename(self.real) or "rules.yaml"
        self.copy = os.path.join(self.tmpdir, base)
        fd = os.open(self.copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orig.data)

    def _run_editor(self) -> None:
        argv = editor_argv(self.environ) + [self.copy]
        # Like system(3): while the editor runs, Ctrl-C and Ctrl-\ are the editor's business.
        # A Python-level handler (not SIG_IGN) is reset to the default in the child by exec.
        old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGQUIT)}
        try:
            try:
                p = subprocess.Popen(argv, env=dict(self.environ))
            except OSError as e:
                raise EditError(f"cannot run the editor {printable(argv[0])}: {e.strerror or e}: "
                                f"nothing changed") from None
            rc = p.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if rc != 0:
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise EditError(f"the editor {printable(argv[0])} {how}: changes discarded, "
                            f"{printable(self.display)} not changed")

    def _edit_until_valid(self, orig: _Original) -> Optional[bytes]:
        """The edited, valid bytes; None when nothing changed. Raises EditError otherwise."""
        while True:
            self._run_editor()
            try:
                with open(self.copy, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise EditError(f"the edited copy {printable(self.copy)} cannot be read "
                                f"({e.strerror}): {printable(self.display)} not changed") from None
            if data == orig.data:
                self.ui.info(f"{printable(self.display)}: no changes")
                return None
            try:
                loader.loads(data, self.display)
                return data
            except RulesError as e:
                problems = e.problems
            for p in problems:
                self.ui.error(printable(str(p)))
            n = len(problems)
            self.ui.error(f"flowpacer: {n} problem{'s' if n != 1 else ''} in the edited version "
                          f"of {printable(self.display)} (the file itself is unchanged)")
            while True:
                answer = self.ui.ask("(e)dit again, (d)iscard? ")
                if answer is None:
                    raise EditError("not a terminal, cannot ask: changes discarded", code=2)
                a = answer.strip().lower()
                if a in ("e", "edit"):
                    break
                if a in ("d", "discard", "q", "x"):
                    raise EditError("changes discarded", code=2)

    # ------------------------------------------------------------- replace
    def _check_unchanged(self, orig: _Original) -> None:
        kept = f"; your version is kept in {printable(self.copy)}"
        try:
            with open(self.real, "rb") as f:
                now = f.read()
        except FileNotFoundError:
            self.keep = True
            raise EditError(f"{printable(self.display)} was deleted while you edited it: "
                            f"nothing saved{kept}") from None
        except OSError as e:
            self.keep = True
            raise EditError(f"{printable(self.display)} cannot be read any more ({e.strerror}): "
                            f"nothing saved{kept}") from None
        if _digest(now) != orig.digest:
            self.keep = True
            raise EditError(f"{printable(self.display)} was changed by someone else while you "
                            f"edited it: not replaced{kept}")

    def _replace(self, orig: _Original, data: bytes) -> None:
        try:
            st = os.stat(self.real)          # owner and mode as they are now
            uid, gid, mode = st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)
        except OSError:
            uid, gid, mode = orig.uid, orig.gid, orig.mode
        try:
            write_atomic(self.real + ".bak", orig.data, uid, gid, mode)
            write_atomic(self.real, data, uid, gid, mode)
            _fsync_dir(os.path.dirname(self.real) or ".")
        except OSError as e:
            self.keep = True
            raise EditError(f"cannot replace {printable(self.display)}: {e.strerror or e}: "
                            f"nothing saved; your version is kept in {printable(self.copy)}") from None
        log.info("replaced %s (previous version in %s.bak)", self.real, self.real)
        # the .bak is next to the file really replaced (a symlink's target)
        bak = self.display if os.path.abspath(self.display) == self.real else self.real
        self.ui.info(f"{printable(self.display)} saved (previous version in {printable(bak)}.bak)")

    # -------------------------------------------------------------- reload
    def _reload(self, daemon: _Daemon) -> int:
        if daemon.rules is None:
            self.ui.info(f"the daemon was not reloaded: {printable(daemon.error)}")
            return 0
        if os.path.realpath(daemon.rules) != self.real:
            self.ui.info(f"the daemon was not reloaded: it uses {printable(daemon.rules)}, "
                         f"not {printable(self.display)}")
            return 0
        try:
            r = parse_reload(control.call(self.socket_path, {"cmd": "reload"},
                                          timeout=RELOAD_TIMEOUT))
        except (FlowpacerError, ValueError) as e:
            self.ui.error(f"flowpacer: saved, but the reload failed: {printable(e)}")
            return 1
        if not r.ok:
            for e in r.errors:
                self.ui.error(printable(e))
            self.ui.error("flowpacer: saved, but the daemon refused the new rules and keeps "
                          "the previous ones")
            return 1
        self.ui.info(describe_reload(r))
        for e in r.errors:
            self.ui.error(f"warning: {printable(e)}")
        return 0


def describe_reload(r: ReloadResult) -> str:
    """One line: what a reload did."""
    parts = ["rules changed" if r.rules_changed else "rules unchanged (comments or layout only)"]
    if r.switched_backend:
        parts.append("backend switched")
    parts.append(f"{r.changed} flows re-rated")
    parts.append(f"{r.added} added")
    parts.append(f"{r.removed} removed")
    if r.errors:
        parts.append(f"{len(r.errors)} errors")
    return "daemon reloaded: " + ", ".join(parts)


def edit(file: Optional[str], socket_path: str, ui: Optional[UI] = None) -> int:
    """Run one edit session; returns the exit status."""
    return Session(file, socket_path, ui or TerminalUI()).run()
