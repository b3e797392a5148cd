"""The control socket: one JSON request per connection, one JSON answer.

The socket is created with mode 0600 in a directory of mode 0700, and every peer's credentials
are checked (SO_PEERCRED): only root (or the daemon's own uid) may ask anything.

It is served by its own stage (``ControlServer.run``), off the daemon's main loop, so that no
client can hold up signals, the sock_diag rescan or the tracer. Every client is non-blocking
and multiplexed with ``selectors`` under hard bounds:

- ``RECV_DEADLINE_S`` to receive a whole request (a slow drip or a silent client is cut off
  then, whatever it does), ``SEND_DEADLINE_S`` to take the answer;
- at most ``MAX_CLIENTS`` clients at once. One more takes the place of the oldest client that
  has been sending its request for over ``EVICT_AGE_S`` (a local client sends its request at
  once: one that has not is slow or silent, and is told so); when there is none it gets
  ``{"error": "busy"}`` and is closed (``call`` tries again until its timeout);
- ``MAX_REQUEST`` bytes per request and ``MAX_DEPTH`` levels of JSON nesting, the depth counted
  before ``json.loads`` sees the text (so a request of 100 000 ``[`` costs one regex pass and
  can never reach Python's recursion limit);
- every refused request gets a one-line JSON ``{"error": ...}`` answer.

The handler runs in the control stage's thread, one request at a time.
"""
from __future__ import annotations

import json
import logging
import os
import re
import selectors
import socket
import struct
import time
from typing import Callable, Dict

from flowpacer.errors import FlowpacerError

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/flowpacer/control.sock"
MAX_REQUEST = 64 * 1024        # bytes of one request, its newline included
MAX_DEPTH = 32                 # nesting of JSON arrays/objects in one request
MAX_CLIENTS = 16               # clients served at once
RECV_DEADLINE_S = 1.0          # from accept to the request's last byte
SEND_DEADLINE_S = 1.0          # from the answer being ready to its last byte taken
EVICT_AGE_S = 0.1              # a client still sending after this may lose its place
TICK_S = 0.25                  # the loop beats and looks at the stop flag at least this often

_TOKEN = re.compile(rb'\\.|["\[\]{}]', re.S)


def json_depth(data: bytes, limit: int = 1 << 30) -> int:
    """The deepest nesting of ``[``/``{`` in ``data``, strings skipped: one linear pass of a
    regex tokenizer, no recursion, no backtracking. Counting stops at a backslash outside a
    string (JSON is invalid there, a decoder never goes deeper). Malformed text may count too
    deep, which is harmless: it is refused either way. Stops as soon as ``limit`` is passed."""
    depth = deepest = 0
    in_string = False
    for m in _TOKEN.finditer(data):
        t = m.group()
        if in_string:
            if t == b'"':
                in_string = False
        elif t == b'"':
            in_string = True
        elif t in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif t in (b"]", b"}"):
            depth -= 1
        else:
            break
    return deepest


def parse_request(data: bytes) -> dict:
    """One request's bytes (newline included or not) to a dict; ValueError with a one-line
    reason otherwise. RecursionError cannot happen: the depth is checked first."""
    if len(data) > MAX_REQUEST:
        raise ValueError(f"request larger than {MAX_REQUEST} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("request is not UTF-8") from None
    if json_depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        req = json.loads(text or "{}")
    except (ValueError, RecursionError) as e:   # RecursionError: unreachable, kept as a guard
        raise ValueError(f"not JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(req, dict):
        raise ValueError("not an object")
    return req


Command = Callable[[dict], dict]      # a request -> its answer


def dispatch(commands: Dict[str, Command], req: dict) -> dict:
    """The answer to ``req`` from the command table: ``{"error": ...}`` for an unknown command
    or a command that failed with a FlowpacerError (its one-line reason)."""
    cmd = req.get("cmd")
    fn = commands.get(cmd) if isinstance(cmd, str) else None
    if fn is None:
        return {"error": f"unknown command {cmd!r}"}
    try:
        return fn(req)
    except FlowpacerError as e:
        return {"error": str(e)}


def command_handler(commands: Dict[str, Command]) -> Command:
    """A ``ControlServer`` handler that answers from the command table ``commands``
    (``{"status": ..., "reload": ..., "ping": ...}``)."""
    table = dict(commands)
    return lambda req: dispatch(table, req)


def _line(answer: dict) -> bytes:
    return json.dumps(answer).encode() + b"\n"


def _close(conn: socket.socket) -> None:
    """Close after taking what the client sent and we did not read: closing a Unix socket with
    unread bytes makes the peer's next read fail (ECONNRESET) before it sees our answer."""
    try:
        conn.setblocking(False)
        for _ in range(4):                   # bounded: a client that keeps writing is cut
            if not conn.recv(MAX_REQUEST):
                break
    except OSError:
        pass
    conn.close()


class _Client:
    __slots__ = ("sock", "data", "out", "deadline", "what", "since")

    def __init__(self, sock: socket.socket, since: float, deadline: float):
        self.sock = sock
        self.since = since
        self.data = b""
        self.out = b""            # the answer, once there is one
        self.deadline = deadline
        self.what = "request"


class ControlServer:
    def __init__(self, path: str, handler: Callable[[dict], dict], *,
                 max_clients: int = MAX_CLIENTS, recv_deadline_s: float = RECV_DEADLINE_S,
                 send_deadline_s: float = SEND_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.handler = handler
        self.max_clients = max_clients
        self.recv_deadline_s = recv_deadline_s
        self.send_deadline_s = send_deadline_s
        self.clock = clock
        self.refused = {"busy": 0, "timeout": 0, "evicted": 0, "bad": 0, "uid": 0}
        d = os.path.dirname(path) or "."
        os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    # ------------------------------------------------------------------ the stage
    def run(self, ctx) -> None:
        """Serve clients until ``ctx.stopping()``; beats at least every ``TICK_S``. Restartable:
        clients of a run that failed are closed, the listening socket stays."""
        sel = selectors.DefaultSelector()
        clients: Dict[int, _Client] = {}
        sel.register(self.sock, selectors.EVENT_READ, None)
        try:
            while not ctx.stopping():
                now = self.clock()
                timeout = TICK_S
                if clients:
                    timeout = max(0.0, min(timeout, min(c.deadline for c in clients.values()) - now))
                for key, _ev in sel.select(timeout):
                    if key.data is None:
                        self._accept(sel, clients)
                    else:
                        self._service(sel, clients, key.data)
                now = self.clock()
                for c in [c for c in clients.values() if now >= c.deadline]:
                    self.refused["timeout"] += 1
                    log.debug("control: client took longer than its deadline for its %s", c.what)
                    if not c.out:        # still receiving: say why, if it takes a line
                        self._try_send(c.sock, _line({"error": "request timed out"}))
                    self._drop(sel, clients, c)
                ctx.beat()
        finally:
            for c in list(clients.values()):
                self._drop(sel, clients, c)
            sel.close()

    def _accept(self, sel, clients: Dict[int, _Client]) -> None:
        for _ in range(64):                  # a burst is taken at once, the loop stays fair
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:             # e.g. EMFILE: the pending client waits, we go on
                log.warning("control: accept: %s", e)
                return
            conn.setblocking(False)
            try:
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            except OSError as e:
                log.debug("control: peer credentials: %s", e)
                conn.close()
                continue
            if uid not in (0, os.getuid()):
                self.refused["uid"] += 1
                log.warning("control: refused uid %d (pid %d)", uid, pid)
                self._try_send(conn, _line({"error": "permission denied"}))
                _close(conn)
                continue
            now = self.clock()
            if len(clients) >= self.max_clients:
                slow = [c for c in clients.values() if not c.out and now - c.since >= EVICT_AGE_S]
                if not slow:
                    self.refused["busy"] += 1
                    log.debug("control: %d clients already: pid %d told busy", len(clients), pid)
                    self._try_send(conn, _line({"error": "busy"}))
                    _close(conn)
                    continue
                old = min(slow, key=lambda c: c.since)
                self.refused["evicted"] += 1
                log.debug("control: a client sending for %.2f s makes way for pid %d",
                          now - old.since, pid)
                self._try_send(old.sock, _line({"error": "request too slow"}))
                self._drop(sel, clients, old)
            c = _Client(conn, now, now + self.recv_deadline_s)
            clients[conn.fileno()] = c
            sel.register(conn, selectors.EVENT_READ, c)

    def _service(self, sel, clients: Dict[int, _Client], c: _Client) -> None:
        if c.out:
            self._send_more(sel, clients, c)
            return
        try:
            chunk = c.sock.recv(MAX_REQUEST + 1 - len(c.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("control: recv: %s", e)
            self._drop(sel, clients, c)
            return
        c.data += chunk
        nl = c.data.find(b"\n")
        if nl >= 0:
            c.data = c.data[:nl + 1]
        elif chunk and len(c.data) <= MAX_REQUEST:
            return                           # more to come (within the deadline)
        self._answer(sel, clients, c)

    def _answer(self, sel, clients: Dict[int, _Client], c: _Client) -> None:
        try:
            req = parse_request(c.data)
        except ValueError as e:
            self.refused["bad"] += 1
            answer = {"error": f"bad request: {e}"}
        else:
            t0 = self.clock()
            try:
                answer = self.handler(req)
            except Exception as e:       # a handler bug: logged once here, the socket lives on
                log.exception("control: request %r failed", req.get("cmd"))
                answer = {"error": f"internal error: {type(e).__name__}: {e}"}
            spent = self.clock() - t0
            for other in clients.values():      # a slow reload is not the others' fault
                other.deadline += spent
        c.data = b""
        c.out = _line(answer)
        c.what = "answer"
        c.deadline = self.clock() + self.send_deadline_s
        try:
            sel.modify(c.sock, selectors.EVENT_WRITE, c)
        except (OSError, ValueError, KeyError):
            self._drop(sel, clients, c)
            return
        self._send_more(sel, clients, c)

    def _send_more(self, sel, clients, c: _Client) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:                 # the client left: nothing to tell anyone
            log.debug("control: send: %s", e)
            self._drop(sel, clients, c)
            return
        c.out = c.out[n:]
        if not c.out:
            self._drop(sel, clients, c)

    @staticmethod
    def _try_send(conn: socket.socket, data: bytes) -> None:
        try:
            conn.setblocking(False)
            conn.send(data)
        except OSError:
            pass

    @staticmethod
    def _drop(sel, clients: Dict[int, _Client], c: _Client) -> None:
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        for k in [k for k, v in clients.items() if v is c]:
            del clients[k]
        _close(c.sock)

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def call(path: str, request: Dict, timeout: float = 30.0) -> dict:
    """Send one request to a running daemon; raises FlowpacerError with a one-line reason.
    A daemon that is busy with other clients is asked again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _call_once(path, request, max(0.05, deadline - time.monotonic()))
        except _Busy:
            if time.monotonic() + 0.02 >= deadline:
                raise FlowpacerError(f"control socket {path}: busy with other clients") from None
            time.sleep(0.02)


class _Busy(Exception):
    pass


def _call_once(path: str, request: Dict, timeout: float) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except BlockingIOError:         # its backlog is full: as busy
            raise _Busy() from None
        except OSError as e:
            raise FlowpacerError(f"no daemon answers on {path}: {e.strerror}") from None
        try:
            s.sendall(json.dumps(request).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                  # refused before it read: its one-line reason may still be there
        data = b""
        while True:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                # closed with our request unread (a refusal: AF_UNIX then resets us after its
                # one-line reason, or before any): the reason if it came, else asked again
                if not data:
                    raise _Busy() from None
                break
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise FlowpacerError(f"control socket {path}: {e}") from None
    finally:
        s.close()
    try:
        answer = json.loads(data.decode())
    except ValueError:
        raise FlowpacerError(f"control socket {path}: unreadable answer") from None
    if not isinstance(answer, dict):
        raise FlowpacerError(f"control socket {path}: unreadable answer")
    if answer.get("error") == "busy":
        raise _Busy()
    if "error" in answer:
        raise FlowpacerError(answer["error"])
    return answer
