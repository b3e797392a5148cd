"""The rules loader: a YAML file -> a validated, immutable ``model.RuleSet``.

Like fail2ban's configuration, the daemon never looks at YAML: this module is the
only place that does.  Every field is declared once (``Field`` tables below) with
its parser, default and documentation; the same tables drive validation, the
"did you mean" hints and ``describe``.

Every problem of a file is collected and raised at once as
``errors.RulesError``; each renders as ``FILE:LINE:COL: rule 'NAME': FIELD: msg``
(1-based, pointing at the offending YAML node).  No input (bad UTF-8, YAML syntax
errors, huge numbers, deep nesting, alias bombs) raises anything else.

Scalars are read from their source text, not from YAML 1.1's type guesses:
``process: yes`` is the command ``yes``, ``local_port: 80:90`` is refused
rather than read as the sexagesimal integer 4890.
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import os
import pwd
import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml
from yaml.composer import Composer
from yaml.error import MarkedYAMLError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

try:
    from yaml._yaml import CParser as _CParser
except ImportError:  # pragma: no cover
    _CParser = None

from flowpacer import units
from flowpacer.kernel.backend import registry as backend_registry
from flowpacer.errors import FlowpacerError, RuleProblem, RulesError
from flowpacer.model import (DEFAULT_IDLE_TIMEOUT_NS, BackendKind, Direction, InterfaceSpec,
                             Match, PortSet, Protocol, Rule, RuleSet)
from flowpacer.text import quoted as _show

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 20          # a rules file larger than 1 MiB is refused
MAX_PROBLEMS = 100           # reported at once; then one "... and N more" line
MAX_DEPTH = 16               # YAML nesting deeper than this is refused
COMM_MAX = 15                # TASK_COMM_LEN - 1: the kernel's comm is at most 15 bytes
IFNAME_MAX = 15              # IFNAMSIZ - 1
NAME_MAX = 64                # rule names
PATH_MAX = 4096
UID_MAX = 2**32 - 2          # (uid_t)-1 is "no user"
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")

_T = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_T + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
_NULL = _T + "null"


# ------------------------------------------------------------------ plumbing

class _Invalid(Exception):
    """One problem with one node (the field's label is added by the caller)."""

    def __init__(self, node: Node, message: str):
        super().__init__(message)
        self.node = node
        self.message = message


class _Reported(Exception):
    """Problems were already recorded (e.g. several bad items of one list)."""


class _Collector:
    def __init__(self, path: str):
        self.path = path
        self.problems: List[RuleProblem] = []
        self.warnings: List[RuleProblem] = []   # reported, but the file still loads

    def warn(self, node: Node, where: str, message: str) -> None:
        m = node.start_mark
        text = f"{where}: warning: {message}" if where else f"warning: {message}"
        self.warnings.append(RuleProblem(self.path, m.line + 1, m.column + 1, text))

    def add(self, line: int, col: int, where: str, message: str) -> None:
        text = f"{where}: {message}" if where else message
        self.problems.append(RuleProblem(self.path, line, col, text))

    def at(self, node: Node, where: str, message: str) -> None:
        m = node.start_mark
        self.add(m.line + 1, m.column + 1, where, message)


@dataclass
class _Env:
    """What a field parser may need besides its node."""
    col: _Collector
    label: str = ""                      # "rule 'x'" / "rule #2" / "" (top level)
    prefix: str = ""                     # "match." for match fields
    link_bps: Optional[int] = None
    link_bad: bool = False               # link_rate was given but refused
    strict_units: bool = False           # tc's byte units ("kbps") are refused, not warned about

    def where(self, field_name: str) -> str:
        f = self.prefix + field_name
        return f"{self.label}: {f}" if self.label else f

    def context(self) -> str:
        """The label of the mapping itself: "rule 'x': match", "rule 'x'", ""."""
        parts = [p for p in (self.label, self.prefix.rstrip(".")) if p]
        return ": ".join(parts)

    def report(self, node: Node, field_name: str, message: str) -> None:
        self.col.at(node, self.where(field_name), message)


@dataclass(frozen=True)
class Field:
    """One key of a mapping: declared once, used to validate and to document."""
    name: str
    parse: Callable[[Node, "_Env", str], Any]   # (value node, env, field name) -> value
    default: Any
    required: bool
    doc: str
    example: str = ""
    default_doc: str = ""                 # how the docs show the default ("" = derive)


def _kind(node: Node) -> str:
    if node.tag == _T + "merge":
        return "a merge key '<<' (not supported: write the keys out)"
    if node.tag not in _SCALAR_TAGS | {_T + "seq", _T + "map"}:
        return f"a value tagged {_show(node.tag)}"
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == _NULL:
        return "nothing"
    return _show(node.value)


def _scalar(node: Node, what: str) -> str:
    """The source text of a scalar node (whatever YAML 1.1 would have guessed it is)."""
    if not isinstance(node, ScalarNode):
        raise _Invalid(node, f"expected {what}, found {_kind(node)}")
    if node.tag == _NULL:
        raise _Invalid(node, f"no value (expected {what}; remove the key to use the default)")
    if node.tag not in _SCALAR_TAGS:
        raise _Invalid(node, f"unsupported YAML tag {_show(node.tag)}")
    return node.value


def _items(node: Node, env: _Env, name: str, one: Callable[[Node], Any], what: str) -> Tuple:
    """A scalar or a non-empty list of scalars, each parsed by ``one``; every bad
    item is reported."""
    if isinstance(node, SequenceNode):
        if node.tag != _T + "seq":
            raise _Invalid(node, f"unsupported YAML tag {_show(node.tag)}")
        if not node.value:
            raise _Invalid(node, f"empty list (expected {what}, or a list of them; "
                                 "remove the key to match any)")
        out, bad = [], False
        for item in node.value:
            try:
                if isinstance(item, SequenceNode) or isinstance(item, MappingNode):
                    raise _Invalid(item, f"expected {what}, found {_kind(item)}")
                out.append(one(item))
            except _Invalid as e:
                env.report(e.node, name, e.message)
                bad = True
        if bad:
            raise _Reported()
        return tuple(out)
    return (one(node),)


def _has_control(s: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in s)


# ------------------------------------------------------------ field parsers

def _p_ifname(node: Node, env: _Env, name: str) -> str:
    s = _scalar(node, "an interface name")
    n = len(s.encode("utf-8", "surrogatepass"))
    if n == 0:
        raise _Invalid(node, "empty interface name")
    if n > IFNAME_MAX:
        raise _Invalid(node, f"{_show(s)} is too long: a Linux interface name is at most "
                             f"{IFNAME_MAX} bytes")
    if s in (".", ".."):
        raise _Invalid(node, f"{_show(s)} is not a valid interface name")
    bad = [c for c in s if c in "/:\0" or c.isspace()]
    if bad:
        raise _Invalid(node, f"{_show(s)}: an interface name cannot contain {_show(bad[0])} "
                             "(no '/', ':', whitespace)")
    return s


def _p_if_link_rate(node: Node, env: _Env, name: str) -> int:
    """An interface's own link_rate (issue 29): like the top-level one, but the rules'
    percentages keep meaning the top-level link_rate."""
    s = _rate_text(node)
    if s.strip().endswith("%"):
        raise _Invalid(node, f"{_show(s)}: link_rate cannot be a percentage (give e.g. '1gbit')")
    try:
        value = units.parse_rate(s)
    except ValueError as e:
        raise _Invalid(node, str(e)) from None
    _byte_units(node, env, name, s)
    return value


def _p_interfaces(node: Node, env: _Env, name: str) -> Tuple[InterfaceSpec, ...]:
    """``interfaces:`` (issue 29): a list of names, globs (``eth*``) and mappings
    ``{name: eth1, link_rate: 10gbit}``; every bad entry is reported at its own place."""
    items = node.value if isinstance(node, SequenceNode) and node.tag == _T + "seq" else None
    if items is None:
        if isinstance(node, ScalarNode):
            items = [node]
        else:
            raise _Invalid(node, f"expected a list of interfaces, found {_kind(node)}")
    if not items:
        raise _Invalid(node, "empty list (expected interface names, globs like 'eth*' or "
                             "mappings {name: eth1, link_rate: 10gbit}); remove the key to "
                             "use 'interface'")
    out: List[InterfaceSpec] = []
    seen: Dict[str, Node] = {}
    bad = False
    for item in items:
        try:
            if isinstance(item, MappingNode):
                sub = _Env(col=env.col, label=env.where(name), strict_units=env.strict_units)
                values, ok = _mapping(item, IFACE_FIELDS, sub)
                if not ok:
                    bad = True
                    continue
                spec, at = InterfaceSpec(values["name"], values["link_rate"]), \
                    _lookup(item, "name")
            elif isinstance(item, ScalarNode):
                spec, at = InterfaceSpec(_p_ifname(item, env, name)), item
            else:
                raise _Invalid(item, f"expected an interface name, a glob or a mapping "
                                     f"{{name: ..., link_rate: ...}}, found {_kind(item)}")
            if spec.name in seen:
                raise _Invalid(at, f"{_show(spec.name)} is listed twice (first at line "
                                   f"{seen[spec.name].start_mark.line + 1})")
            seen[spec.name] = at
            out.append(spec)
        except _Invalid as e:
            env.report(e.node, name, e.message)
            bad = True
    if bad:
        raise _Reported()
    return tuple(out)


def _choice(node: Node, kind, what: str, choices: str):
    """One of an enum's values, or "'x' is not a WHAT: use CHOICES; did you mean ...?"."""
    s = _scalar(node, choices)
    try:
        return kind(s)
    except ValueError:
        raise _Invalid(node, f"{_show(s)} is not a {what}: use {choices}"
                             + _hint(s.lower(), [k.value for k in kind])) from None


def _p_backend(node: Node, env: _Env, name: str) -> BackendKind:
    return _choice(node, BackendKind, "backend", backend_registry.choices_text())


def _rate_text(node: Node) -> str:
    s = _scalar(node, "a rate like '8mbit'")
    if node.tag == _T + "bool":
        raise _Invalid(node, f"{_show(s)} is not a rate (expected e.g. '8mbit')")
    return s


def _byte_units(node: Node, env: _Env, name: str, text: str) -> None:
    """tc's byte units ("320kbps" is 2.56 Mbit/s, not 320 kbit/s): a warning at the value, or
    with ``strict_units`` (``rules check --strict``, ``run --strict-units``) an error."""
    msg = units.byte_unit_warning(text)
    if msg is None:
        return
    if env.strict_units:
        raise _Invalid(node, msg.replace(" without this warning", "") + " (strict units)")
    env.col.warn(node, env.where(name), msg)


def _p_link_rate(node: Node, env: _Env, name: str) -> int:
    """Also records the link rate in ``env`` for the rules' percentages and checks
    (TOP_FIELDS lists link_rate before rules)."""
    env.link_bad = True
    s = _rate_text(node)
    if s.strip().endswith("%"):
        raise _Invalid(node, f"{_show(s)}: link_rate cannot be a percentage (give e.g. '1gbit')")
    try:
        env.link_bps = units.parse_rate(s)
    except ValueError as e:
        raise _Invalid(node, str(e)) from None
    _byte_units(node, env, name, s)
    env.link_bad = False
    return env.link_bps


def _p_rate(node: Node, env: _Env, name: str) -> int:
    s = _rate_text(node)
    if s.strip().endswith("%") and env.link_bad:
        raise _Invalid(node, f"{_show(s)}: a percentage needs a valid link_rate")
    try:
        value = units.parse_rate(s, link_bps=env.link_bps)
    except ValueError as e:
        raise _Invalid(node, str(e)) from None
    _byte_units(node, env, name, s)
    return value


def _p_name(node: Node, env: _Env, name: str) -> str:
    s = _scalar(node, "a rule name")
    if not NAME_RE.fullmatch(s):
        raise _Invalid(node, f"{_show(s)} is not a valid rule name "
                             "(letters, digits, '_', '.', '-' only)")
    if len(s) > NAME_MAX:
        raise _Invalid(node, f"rule name too long ({len(s)} characters, at most {NAME_MAX})")
    return s


def _glob_min_len(pattern: str) -> int:
    """The fewest bytes a string matching ``pattern`` (fnmatch syntax) can have."""
    n, i = 0, 0
    while i < len(pattern):
        c = pattern[i]
        i += 1
        if c == "*":
            continue
        if c == "[":
            j = i
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            while j < len(pattern) and pattern[j] != "]":
                j += 1
            if j < len(pattern):          # a class: one character
                i = j + 1
                n += 1
                continue
            n += 1                        # an unclosed '[' is a literal
            continue
        n += len(c.encode("utf-8", "surrogatepass"))
    return n


def _one_process(node: Node) -> str:
    s = _scalar(node, "a process name (comm) or glob")
    if not s:
        raise _Invalid(node, "empty process name")
    if _has_control(s):
        raise _Invalid(node, f"{_show(s)}: control characters are not allowed")
    need = _glob_min_len(s)
    if need > COMM_MAX:
        if any(c in s for c in "*?["):
            raise _Invalid(node, f"{_show(s)} needs at least {need} characters but a comm is at "
                                 f"most {COMM_MAX}: it can never match (match exe for full names)")
        short = s.encode("utf-8", "surrogatepass")[:COMM_MAX].decode("utf-8", "ignore")
        raise _Invalid(node, f"{_show(s)} is {need} characters but the kernel's comm is at most "
                             f"{COMM_MAX}: it can never match; use {_show(short)} or match exe")
    return s


def _one_exe(node: Node) -> str:
    s = _scalar(node, "an absolute path or glob")
    if not s.startswith("/"):
        raise _Invalid(node, f"{_show(s)} is not an absolute path (exe must start with '/', "
                             "e.g. /usr/bin/rsync or /usr/bin/python3*)")
    if _has_control(s):
        raise _Invalid(node, f"{_show(s)}: control characters are not allowed")
    if len(s.encode("utf-8", "surrogatepass")) > PATH_MAX:
        raise _Invalid(node, f"path too long (at most {PATH_MAX} bytes)")
    return s


def _one_user(node: Node) -> int:
    s = _scalar(node, "a user name or uid")
    if node.tag != _T + "int" or not s.isdigit():
        try:
            return pwd.getpwnam(s).pw_uid
        except (KeyError, ValueError, OverflowError):
            pass
    if s.isascii() and s.isdigit():
        if len(s) > 10 or int(s) > UID_MAX:
            raise _Invalid(node, f"uid {_show(s)} out of range (0..{UID_MAX})")
        return int(s)
    if s.startswith("-") and s[1:].isdigit():
        raise _Invalid(node, f"uid {_show(s)} out of range (0..{UID_MAX})")
    try:
        names = [p.pw_name for p in pwd.getpwall()]
    except Exception:  # pragma: no cover - odd NSS setups
        names = []
    raise _Invalid(node, f"unknown user {_show(s)}" + _hint(s, names))


def _p_process(node: Node, env: _Env, name: str) -> Tuple[str, ...]:
    return _items(node, env, name, _one_process, "a process name (comm) or glob")


def _p_exe(node: Node, env: _Env, name: str) -> Tuple[str, ...]:
    return _items(node, env, name, _one_exe, "an absolute path or glob")


def _p_user(node: Node, env: _Env, name: str) -> Tuple[int, ...]:
    return _items(node, env, name, _one_user, "a user name or uid")


def _p_direction(node: Node, env: _Env, name: str) -> Direction:
    s = _scalar(node, "inbound, outbound or any")
    try:
        return Direction(s)
    except ValueError:
        raise _Invalid(node, f"{_show(s)} is not a direction: use inbound (accepted), "
                             "outbound (connected) or any"
                             + _hint(s.lower(), [d.value for d in Direction])) from None


def _p_protocol(node: Node, env: _Env, name: str) -> Protocol:
    return _choice(node, Protocol, "protocol", "tcp, udp or any")


_DURATION_RE = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*(ns|us|ms|s|m|h)?")
_DURATION_NS = {"ns": 1, "us": 1000, "ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000, "h": 3600_000_000_000}
MIN_IDLE_TIMEOUT_NS, MAX_IDLE_TIMEOUT_NS = 1_000_000_000, 86400_000_000_000


def _p_idle_timeout(node: Node, env: _Env, name: str) -> int:
    s = _scalar(node, "a duration like 30s, 500ms, 2m")
    m = _DURATION_RE.fullmatch(s.strip())
    if m is None:
        raise _Invalid(node, f"{_show(s)} is not a duration: write e.g. 30s, 1500ms, 2m or 1h")
    ns = int(Fraction(m[1]) * _DURATION_NS[m[2] or "s"])
    if not MIN_IDLE_TIMEOUT_NS <= ns <= MAX_IDLE_TIMEOUT_NS:
        raise _Invalid(node, f"{_show(s)} is out of range: an idle timeout is 1s..24h")
    return ns


# issue 26: at most as many ready spare classes as a backend keeps spares (handles.SPARE_MAX;
# a test checks they agree: the policy does not import the kernel side)
READY_CLASSES_MAX = 16384


def _p_ready_classes(node: Node, env: _Env, name: str) -> int:
    s = _scalar(node, "a number of classes like 2000")
    t = s.strip()
    if node.tag != _T + "int" or not (t.isascii() and t.isdigit()):
        raise _Invalid(node, f"{_show(s)} is not a number of classes: write e.g. 2000 (0: none)")
    if len(t) > 6 or int(t) > READY_CLASSES_MAX:
        raise _Invalid(node, f"{_show(s)} is out of range: at most {READY_CLASSES_MAX} ready "
                             "classes an interface")
    return int(t)


_PORT_RE = re.compile(r"([0-9]{1,6})(?:\s*-\s*([0-9]{1,6}))?")


def _one_port(node: Node) -> Tuple[int, int]:
    s = _scalar(node, "a port, a range like 8000-8100")
    m = _PORT_RE.fullmatch(s.strip())
    if m is None:
        hint = " (write a range as 8000-8100)" if ":" in s else ""
        raise _Invalid(node, f"{_show(s)} is not a port or a port range{hint}")
    lo = int(m[1])
    hi = int(m[2]) if m[2] is not None else lo
    for p in (lo, hi):
        if not 1 <= p <= 65535:
            raise _Invalid(node, f"port {p} out of range (1..65535)")
    if lo > hi:
        raise _Invalid(node, f"{_show(s)}: range start {lo} is above its end {hi}")
    return (lo, hi)


def _p_ports(node: Node, env: _Env, name: str) -> PortSet:
    return PortSet(_items(node, env, name, _one_port, "a port or a range like 8000-8100"))


def _one_remote(node: Node) -> Any:
    s = _scalar(node, "an address or a CIDR network")
    text = s.strip()
    if "%" in text or not text or not re.fullmatch(r"[0-9A-Fa-f:./]+", text) \
            or not any(c in text for c in ".:"):
        raise _Invalid(node, f"{_show(s)} is not an IPv4/IPv6 address or CIDR network")
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        try:
            loose = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise _Invalid(node, f"{_show(s)} is not an IPv4/IPv6 address or CIDR network "
                                 f"({e})") from None
        raise _Invalid(node, f"{_show(s)} has host bits set; did you mean '{loose}'?") from None


_MAPPED = ipaddress.ip_network("::ffff:0:0/96")


def _p_remote(node: Node, env: _Env, name: str) -> Tuple[Any, ...]:
    nets = _items(node, env, name, _one_remote, "an address or a CIDR network")
    items = node.value if isinstance(node, SequenceNode) else [node]
    for item, net in zip(items, nets):
        if net.version == 6 and net.prefixlen >= 96 and net.subnet_of(_MAPPED):
            v4 = ipaddress.ip_network((net.network_address.ipv4_mapped, net.prefixlen - 96))
            env.col.warn(item, env.where(name),
                         f"{_show(item.value.strip())} never matches: an IPv4-mapped address is the IPv4 "
                         f"address it carries, as on the wire (write '{v4}')")
    return nets


MATCH_FIELDS: Tuple[Field, ...] = (
    Field("process", _p_process, (), False,
          "the process's comm (its first 15 characters), a glob; a string or a list",
          "musicd", "any"),
    Field("exe", _p_exe, (), False,
          "the absolute path of the process's executable, a glob; a string or a list",
          "/usr/bin/rsync", "any"),
    Field("user", _p_user, (), False,
          "the process's user: a name (resolved when the file is loaded) or a uid; or a list",
          "www-data", "any"),
    Field("direction", _p_direction, Direction.ANY, False,
          "inbound (the process accepted the connection), outbound (it connected) or any",
          "inbound"),
    Field("local_port", _p_ports, PortSet(), False,
          "the flow's local port: a number, a range '8000-8100', or a list of those", "8443",
          "any"),
    Field("remote_port", _p_ports, PortSet(), False,
          "the flow's remote port: a number, a range '8000-8100', or a list of those", "443",
          "any"),
    Field("remote", _p_remote, (), False,
          "the peer's address: an IPv4/IPv6 address or CIDR network, or a list", "192.0.2.0/24",
          "any"),
    Field("protocol", _p_protocol, Protocol.TCP, False,
          "tcp, udp (connected sockets, and each peer an unconnected socket sends to) or any",
          "udp"),
)


def _p_match(node: Node, env: _Env, name: str) -> Match:
    if not isinstance(node, MappingNode) or node.tag != _T + "map":
        if isinstance(node, ScalarNode) and node.tag == _NULL:
            raise _Invalid(node, "no match fields: the rule would shape every flow of every "
                                 "process; give process, exe, user, ports or remote")
        raise _Invalid(node, f"expected a mapping of match fields "
                             f"({', '.join(f.name for f in MATCH_FIELDS)}), found {_kind(node)}")
    sub = dataclasses.replace(env, prefix=env.prefix + name + ".")
    values, ok = _mapping(node, MATCH_FIELDS, sub)
    if not ok:
        raise _Reported()
    m = Match(**values)
    if dataclasses.replace(m, protocol=Protocol.TCP) == Match():
        raise _Invalid(node, "no match fields: the rule would shape every flow of every "
                             "process; give process, exe, user, ports or remote")
    return m


DEFAULT_CLIENT_PREFIX = (32, 64)


def _prefix_len(bits: int) -> Callable[[Node, "_Env", str], int]:
    def parse(node: Node, env: _Env, name: str) -> int:
        s = _scalar(node, f"a prefix length 0..{bits}")
        t = s.strip().lstrip("/")
        if not (t.isascii() and t.isdigit()) or len(t) > 3 or int(t) > bits:
            raise _Invalid(node, f"{_show(s)} is not a prefix length (0..{bits})")
        return int(t)
    return parse


CLIENT_PREFIX_FIELDS: Tuple[Field, ...] = (
    Field("ipv4", _prefix_len(32), DEFAULT_CLIENT_PREFIX[0], False,
          "IPv4 clients are grouped by this prefix length", "32"),
    Field("ipv6", _prefix_len(128), DEFAULT_CLIENT_PREFIX[1], False,
          "IPv6 clients are grouped by this prefix length (a /64 keeps privacy addresses together)",
          "64"),
)


def _p_client_prefix(node: Node, env: _Env, name: str) -> Tuple[int, int]:
    if not isinstance(node, MappingNode) or node.tag != _T + "map":
        raise _Invalid(node, f"expected a mapping like {{ipv4: 32, ipv6: 64}}, found {_kind(node)}")
    sub = dataclasses.replace(env, prefix=env.prefix + name + ".")
    values, ok = _mapping(node, CLIENT_PREFIX_FIELDS, sub)
    if not ok:
        raise _Reported()
    return (values["ipv4"], values["ipv6"])


RULE_FIELDS: Tuple[Field, ...] = (
    Field("name", _p_name, None, True,
          "unique name of the rule: letters, digits, '_', '.', '-'", "streaming"),
    Field("match", _p_match, None, True,
          "which flows the rule paces: every given field must match (see the match fields)",
          "{process: musicd, direction: inbound, local_port: 8443}"),
    Field("rate", _p_rate, None, False,
          "the pacing rate of EACH matching flow, in tc units (or NN% of link_rate); a rule "
          "needs rate, receive_rate or both", "8mbit",
          "none with receive_rate (a receive-only rule: what the flow is sent is not shaped); "
          "else required"),
    Field("ceil", _p_rate, None, False,
          "optional: a flow may borrow idle capacity up to this rate (>= rate)", "600mbit",
          "none (no borrowing)"),
    Field("receive_rate", _p_rate, None, False,
          "optional: what the server accepts from EACH matching flow per second (uploads), "
          "shaped on an ifb device fed from the interface's ingress", "10mbit",
          "none (what the flow sends us is not shaped)"),
    Field("receive_ceil", _p_rate, None, False,
          "optional: a flow's uploads may borrow idle capacity up to this rate "
          "(>= receive_rate; needs receive_rate)", "100mbit", "none (no borrowing)"),
    Field("client_rate", _p_rate, None, False,
          "optional: all flows of this rule from one client together get at most this, shared in "
          "proportion to their rates (rate <= client_rate <= total_rate)", "20mbit",
          "none (no per-client cap)"),
    Field("total_rate", _p_rate, None, False,
          "optional: all flows of this rule together get at most this, shared in proportion to "
          "their rates", "600mbit", "none (no total cap)"),
    Field("client_prefix", _p_client_prefix, DEFAULT_CLIENT_PREFIX, False,
          "what makes one client for client_rate: the remote address masked to these prefix "
          "lengths", "{ipv4: 32, ipv6: 64}", "{ipv4: 32, ipv6: 64}"),
    Field("idle_timeout", _p_idle_timeout, DEFAULT_IDLE_TIMEOUT_NS, False,
          "a UDP flow that sent no datagram for this long is over (1s..24h; TCP flows end when "
          "they close)", "30s", "30s"),
)


def _p_rules(node: Node, env: _Env, name: str) -> Tuple[Rule, ...]:
    if not isinstance(node, SequenceNode) or node.tag != _T + "seq":
        raise _Invalid(node, f"expected a list of rules, found {_kind(node)}")
    rules: List[Rule] = []
    seen: Dict[str, int] = {}
    totals: List[tuple] = []
    bad = False
    for i, item in enumerate(node.value, 1):
        label = f"rule #{i}"
        if not isinstance(item, MappingNode) or item.tag != _T + "map":
            env.col.at(item, label, f"expected a mapping with name, match, rate; "
                                    f"found {_kind(item)}")
            bad = True
            continue
        name_node = _lookup(item, "name")
        if name_node is not None:
            try:
                label = f"rule {_show(_p_name(name_node, env, 'name'))}"
            except _Invalid:
                pass
        renv = dataclasses.replace(env, label=label, prefix="")
        values, ok = _mapping(item, RULE_FIELDS, renv)
        rname = values.get("name")
        if rname is not None and name_node is not None:
            if rname in seen:
                renv.report(name_node, "name",
                            f"duplicate rule name (first defined at line {seen[rname]})")
                ok = False
            else:
                seen[rname] = name_node.start_mark.line + 1
        rate, ceil = values.get("rate"), values.get("ceil")
        link = env.link_bps
        if not _check_sides(item, values, renv):
            ok = False
        if not _within_link(item, values, renv, link, ("rate", "ceil"), "a flow"):
            ok = False
        if rate is not None and ceil is not None and ceil < rate:
            renv.report(_lookup(item, "ceil"), "ceil",
                        f"{units.format_bits(ceil)} is below rate {units.format_bits(rate)} "
                        "(ceil must be >= rate)")
            ok = False
        if not _check_receive(item, values, renv, link):
            ok = False
        if not _check_aggregates(item, values, renv, link):
            ok = False
        if not ok:
            bad = True
            continue
        if values.get("total_rate") is not None:
            totals.append((values["total_rate"], _lookup(item, "total_rate"), renv))
        rules.append(Rule(name=rname, match=values["match"], rate_bps=rate, ceil_bps=ceil,
                          line=item.start_mark.line + 1,
                          receive_rate_bps=values.get("receive_rate"),
                          receive_ceil_bps=values.get("receive_ceil"),
                          client_rate_bps=values.get("client_rate"),
                          total_rate_bps=values.get("total_rate"),
                          client_prefix=values.get("client_prefix", DEFAULT_CLIENT_PREFIX),
                          idle_timeout_ns=values.get("idle_timeout", DEFAULT_IDLE_TIMEOUT_NS)))
    if bad:
        raise _Reported()
    _warn_oversubscribed(totals, env)
    _warn_unreachable(rules, node, env)
    return tuple(rules)


def _warn_unreachable(rules: List[Rule], node: SequenceNode, env: _Env) -> None:
    """Warnings (the file still loads) for what the rules say but cannot do: a rule an earlier
    one shadows (``engine.covers``: every flow it matches, the earlier one matches first), and
    a field the rule's protocol ignores (idle_timeout is for UDP: a TCP flow ends at close)."""
    from flowpacer.policy import engine
    items = [i for i in node.value if isinstance(i, MappingNode)]
    for j, (r, item) in enumerate(zip(rules, items)):
        renv = dataclasses.replace(env, label=f"rule {_show(r.name)}", prefix="")
        for earlier in rules[:j]:
            if engine.covers(earlier, r):
                renv.col.warn(_lookup(item, "match") or item, renv.where("match"),
                              f"never matches: rule {_show(earlier.name)} (line {earlier.line}) "
                              "comes first and matches every flow this rule does (first match "
                              "wins; put the narrower rule first)")
                break
        if r.match.protocol is Protocol.TCP and _given(item, "idle_timeout"):
            renv.col.warn(_lookup(item, "idle_timeout"), renv.where("idle_timeout"),
                          "ignored: idle_timeout is for UDP flows (a TCP flow ends when it "
                          "closes); this rule matches TCP only (give protocol: udp or any)")


def _within_link(item, values: dict, renv, link: Optional[int], keys, who: str) -> bool:
    """Each of ``keys`` given is at most link_rate (else reported: ``who`` can never get it)."""
    ok = True
    for key in keys:
        val = values.get(key)
        if val is not None and link is not None and val > link:
            renv.report(_lookup(item, key), key,
                        f"{units.format_bits(val)} is above link_rate "
                        f"{units.format_bits(link)}: {who} can never get it")
            ok = False
    return ok


def _given(item: MappingNode, key: str) -> bool:
    """Whether the rule mapping names ``key`` (even with a value that was refused)."""
    return key in {k.value for k, _ in item.value if isinstance(k, ScalarNode)}


def _check_sides(item, values: dict, renv) -> bool:
    """A rule shapes the send side (rate), the receive side (receive_rate) or both; without
    rate (a receive-only rule) nothing of the send side (ceil, aggregates) may be given."""
    if _given(item, "rate"):
        return True
    if not _given(item, "receive_rate"):
        renv.report(item, "rate", "missing: give rate (what each flow is sent), receive_rate "
                                  "(what each flow may upload), or both")
        return False
    ok = True
    for key in ("ceil", "client_rate", "total_rate"):
        if _given(item, key):
            renv.report(_lookup(item, key), key,
                        "needs rate (it shapes what is sent; this rule has receive_rate only)")
            ok = False
    return ok


def _check_receive(item, values: dict, renv, link: Optional[int]) -> bool:
    """receive_rate <= receive_ceil, both within the link; receive_ceil only with receive_rate.
    Reports every problem; True when there was none."""
    rrate, rceil = values.get("receive_rate"), values.get("receive_ceil")
    ok = _within_link(item, values, renv, link, ("receive_rate", "receive_ceil"), "a flow")
    if rceil is not None and rrate is None and not _given(item, "receive_rate"):
        renv.report(_lookup(item, "receive_ceil"), "receive_ceil",
                    "needs receive_rate (the rate a flow's uploads are guaranteed)")
        ok = False
    if rrate is not None and rceil is not None and rceil < rrate:
        renv.report(_lookup(item, "receive_ceil"), "receive_ceil",
                    f"{units.format_bits(rceil)} is below receive_rate "
                    f"{units.format_bits(rrate)} (receive_ceil must be >= receive_rate)")
        ok = False
    return ok


def _check_aggregates(item: MappingNode, values: Dict[str, Any], renv: _Env,
                      link: Optional[int]) -> bool:
    """rate <= client_rate <= total_rate, ceil within them, each within the link; client_prefix
    only with client_rate. Reports every problem; True when there was none."""
    rate, ceil = values.get("rate"), values.get("ceil")
    client, total = values.get("client_rate"), values.get("total_rate")
    ok = _within_link(item, values, renv, link, ("client_rate", "total_rate"),
                      "the flows together")
    b = units.format_bits
    if client is not None and rate is not None and client < rate:
        renv.report(_lookup(item, "client_rate"), "client_rate",
                    f"{b(client)} is below rate {b(rate)} (one flow alone would exceed it; "
                    "client_rate must be >= rate)")
        ok = False
    if total is not None and rate is not None and total < rate:
        renv.report(_lookup(item, "total_rate"), "total_rate",
                    f"{b(total)} is below rate {b(rate)} (total_rate must be >= rate)")
        ok = False
    if total is not None and client is not None and total < client:
        renv.report(_lookup(item, "total_rate"), "total_rate",
                    f"{b(total)} is below client_rate {b(client)} "
                    "(total_rate must be >= client_rate)")
        ok = False
    if ceil is not None and rate is not None and ceil >= rate:
        for key, cap in (("client_rate", client), ("total_rate", total)):
            if cap is not None and ceil > cap:
                renv.report(_lookup(item, "ceil"), "ceil",
                            f"{b(ceil)} is above {key} {b(cap)} (a flow cannot borrow past "
                            f"its {key.split('_')[0]}'s cap; ceil must be <= {key})")
                ok = False
                break
    cp = _lookup(item, "client_prefix")
    if cp is not None and client is None and not _given(item, "client_rate"):
        renv.report(cp, "client_prefix", "has no effect without client_rate "
                                         "(it says what one client is for client_rate)")
        ok = False
    return ok


def _warn_oversubscribed(totals, env: _Env) -> None:
    """A warning (the file still loads) when the rules' total_rate values add up to more than
    link_rate: each rule's total is then a cap, not a guarantee."""
    link = env.link_bps
    if link is None:
        return
    run = 0
    for total, node, renv in totals:
        run += total
        if run > link:
            env.col.warn(node, renv.where("total_rate"),
                         f"the total_rate of the rules up to here add up to "
                         f"{units.format_bits(run)}, above link_rate {units.format_bits(link)}: "
                         "the link is oversubscribed, a total is a cap but not a guarantee")
            return


TOP_FIELDS: Tuple[Field, ...] = (
    Field("interface", _p_ifname, "", False,
          "the network interface whose egress is shaped (optional: the CLI can give it)",
          "eth0", "the CLI's --interface"),
    Field("backend", _p_backend, BackendKind.AUTO, False,
          backend_registry.doc_text(), "auto"),
    Field("link_rate", _p_link_rate, None, False,
          "the link's rate in tc units; optional when the interface reports its speed, "
          "required for veth and for NN% rates", "1gbit", "the interface's speed"),
    Field("interfaces", _p_interfaces, (), False,
          "several interfaces (issue 29): a list of names, globs ('eth*', resolved at start, "
          "on reload and at every reconcile pass) and mappings {name: eth1, link_rate: "
          "10gbit}; each flow is shaped on the interface its packets leave by (a route "
          "lookup with the socket's ports, owner, mark and bound device: policy routing by "
          "fwmark, SO_BINDTODEVICE and VRFs followed); each interface has its own receive "
          "side; instead of 'interface'", "[eth0, {name: eth1, link_rate: 10gbit}]",
          "only 'interface'"),
    Field("ready_classes", _p_ready_classes, 0, False,
          "flow classes made ahead on each interface for a flash crowd (issue 26): while "
          "fewer flows are shaped there, the rest wait as spare classes, so a burst of that "
          "many new flows has its classes in without making any (htb: its kernel walks every "
          "class for each class made; psp keeps no spare classes and ignores this); at "
          f"most {READY_CLASSES_MAX}", "2000", "0 (only closed flows' classes are kept)"),
    Field("rules", _p_rules, (), False,
          "the list of rules; the first rule that matches a flow wins, a flow that matches "
          "none is not shaped", "[...]", "[] (shape nothing)"),
)


IFACE_FIELDS = (
    Field("name", _p_ifname, None, True, "the interface's name or a glob like 'eth*'", "eth1"),
    Field("link_rate", _p_if_link_rate, None, False,
          "this interface's link rate (default: the top-level link_rate, else its speed)",
          "10gbit"),
)


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _lookup(node: MappingNode, key: str) -> Optional[Node]:
    for k, v in node.value:
        if isinstance(k, ScalarNode) and k.value == key:
            return v
    return None


def _mapping(node: MappingNode, fields: Tuple[Field, ...], env: _Env) -> Tuple[Dict[str, Any], bool]:
    """Parse a mapping against a field table: unknown and duplicate keys, missing
    required fields and every field's own problems are all reported.  Returns the
    values that parsed (defaults for absent optional fields) and whether all did."""
    known = {f.name: f for f in fields}
    given: Dict[str, Tuple[Node, Node]] = {}
    ok = True
    for k, v in node.value:
        if not isinstance(k, ScalarNode) or k.tag not in _SCALAR_TAGS:
            env.col.at(k, env.context(), f"keys must be plain names, found {_kind(k)}")
            ok = False
            continue
        key = k.value
        shown = key if (NAME_RE.fullmatch(key) and len(key) <= NAME_MAX) else _show(key)
        if key in given:
            env.report(k, shown, f"duplicate key (first at line {given[key][0].start_mark.line + 1})")
            ok = False
            continue
        given[key] = (k, v)
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = (f"did you mean '{close[0]}'?" if close
                    else "valid keys: " + ", ".join(known))
            env.report(k, shown, f"unknown key; {hint}")
            ok = False
    values: Dict[str, Any] = {}
    for f in fields:
        if f.name not in given:
            if f.required:
                env.report(node, f.name, f"missing (required: {f.doc})" if f.name != "match"
                           else "missing: a rule with no match fields would shape every flow "
                                "of every process")
                ok = False
            else:
                values[f.name] = f.default
            continue
        try:
            values[f.name] = f.parse(given[f.name][1], env, f.name)
        except _Invalid as e:
            env.report(e.node, f.name, e.message)
            ok = False
        except _Reported:
            ok = False
    return values, ok


# ----------------------------------------------------------------- the YAML

class _Refused(MarkedYAMLError):
    """Valid YAML that a rules file does not allow (aliases, deep nesting)."""


class _SafeComposer(Composer):
    """The composer of SafeLoader, refusing aliases (no alias bombs, no cycles: a
    rules file has no use for them) and nesting deeper than MAX_DEPTH (the
    composer recurses).  Only nodes are built: nothing is constructed, so no tag
    can run code, and every node keeps its mark for messages."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.get_event()
            raise _Refused(None, None, f"aliases (*{ev.anchor}) are not supported in a "
                           "rules file: write the value out", ev.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                               self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _PyLoader(_SafeComposer, Reader, Scanner, Parser, Resolver):
    def __init__(self, text: str):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        _SafeComposer.__init__(self)
        Resolver.__init__(self)


if _CParser is not None:
    class _CLoader(_SafeComposer, _CParser, Resolver):
        """libyaml's parser (several times faster) under the same Python composer."""

        def __init__(self, text: str):
            _CParser.__init__(self, text)
            _SafeComposer.__init__(self)
            Resolver.__init__(self)
    _Loader = _CLoader
    _POSITION_IN_BYTES = True    # libyaml's ReaderError.position is a UTF-8 byte offset
else:  # pragma: no cover - Debian's python3-yaml has libyaml
    _Loader = _PyLoader
    _POSITION_IN_BYTES = False


def _line_col(text: str, index: int) -> Tuple[int, int]:
    index = max(0, min(index, len(text)))
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, col


def _bad_char(text: str, index: int, col: _Collector) -> None:
    line, c = _line_col(text, index)
    ch = text[index] if 0 <= index < len(text) else None
    what = f"U+{ord(ch):04X}" if ch is not None else "a control character"
    col.add(line, c, "", f"character {what} is not allowed in a YAML file")


def _compose(text: str, col: _Collector, loader_class=None) -> Optional[Node]:
    loader_class = loader_class or _Loader
    try:
        loader = loader_class(text)
        try:
            return loader.get_single_node()
        finally:
            loader.dispose()
    except UnicodeEncodeError as e:      # lone surrogates in a str
        _bad_char(text, e.start, col)
    except ReaderError as e:
        pos = e.position
        if loader_class is not _PyLoader and _POSITION_IN_BYTES:
            pos = len(text.encode("utf-8", "surrogatepass")[:pos].decode("utf-8", "ignore"))
        _bad_char(text, pos, col)
    except MarkedYAMLError as e:
        if loader_class is not _PyLoader and "maximum nesting depth" in str(e.problem):
            # libyaml >= 0.2.5 stops at 1000 levels while it scans ahead, before the composer
            # refuses level 17 where it starts: the Python parser, which does not scan that far
            # ahead, gives the same answer with every libyaml
            return _compose(text, col, _PyLoader)
        mark = e.problem_mark or e.context_mark
        line, c = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        msg = str(e.problem or e.context or "invalid YAML").replace("\n", " ")
        if e.context and e.problem and e.context_mark is not None:
            msg += f" ({e.context} at line {e.context_mark.line + 1})"
        col.add(line, c, "", msg if isinstance(e, _Refused) else f"YAML syntax error: {msg}")
    except yaml.YAMLError as e:   # pragma: no cover - every YAMLError above carries a mark
        col.add(1, 1, "", f"YAML error: {str(e).splitlines()[0] if str(e) else 'invalid'}")
    except RecursionError:        # pragma: no cover - MAX_DEPTH prevents it
        col.add(1, 1, "", "YAML nesting too deep")
    return None


def _decode(data: bytes, col: _Collector) -> Optional[str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        good = data[:e.start].decode("utf-8", "replace")
        line, c = _line_col(good, len(good))
        col.add(line, c, "", f"not UTF-8 text (byte 0x{data[e.start]:02x})")
        return None


def _too_big(n: int, col: _Collector) -> bool:
    if n > MAX_BYTES:
        col.add(1, 1, "", f"the file is larger than {MAX_BYTES // 1024} KiB; refused")
        return True
    return False


def _capped(problems: List[RuleProblem]) -> List[RuleProblem]:
    """In file order, at most MAX_PROBLEMS, then one line saying how many more."""
    ps = sorted(dict.fromkeys(problems), key=lambda p: (p.line, p.col))
    if len(ps) <= MAX_PROBLEMS:
        return ps
    rest = ps[MAX_PROBLEMS]
    more = len(ps) - MAX_PROBLEMS
    return ps[:MAX_PROBLEMS] + [RuleProblem(rest.path, rest.line, rest.col,
                                            f"... and {more} more problems from here on")]


def _build(text: str, path: str, strict_units: bool = False) -> RuleSet:
    col = _Collector(path)
    if _too_big(len(text), col) or _too_big(len(text.encode("utf-8", "surrogatepass")), col):
        raise RulesError(col.problems[:1])
    root = _compose(text, col)
    if col.problems:
        raise RulesError(col.problems)
    keys = ", ".join(f.name for f in TOP_FIELDS)
    if root is None:
        col.add(1, 1, "", f"the file is empty: expected a mapping with {keys}")
        raise RulesError(col.problems)
    if not isinstance(root, MappingNode) or root.tag != _T + "map":
        col.at(root, "", f"the rules file must be a mapping with {keys}, found {_kind(root)}")
        raise RulesError(col.problems)
    env = _Env(col=col, strict_units=strict_units)
    values, ok = _mapping(root, TOP_FIELDS, env)
    if not ok or col.problems:
        raise RulesError(_capped(col.problems))
    if values["interface"] and values["interfaces"]:
        col.at(_lookup(root, "interfaces"), "interfaces",
               "give either 'interface' or 'interfaces', not both")
        raise RulesError(_capped(col.problems))
    warnings = tuple(_capped(col.warnings)) if col.warnings else ()
    return RuleSet(interface=values["interface"], backend=values["backend"],
                   link_rate_bps=values["link_rate"], rules=values["rules"], path=path,
                   warnings=warnings, interfaces=values["interfaces"],
                   ready_classes=values["ready_classes"])


# ------------------------------------------------------------------- the API

def loads(text, path: str = "<string>", strict_units: bool = False) -> RuleSet:
    """Validate rules given as text (``bytes`` must be UTF-8) -> ``RuleSet``.
    Raises ``RulesError`` listing every problem. ``strict_units``: a rate in one of tc's byte
    units ("kbps", "mbps") is a problem, not a warning."""
    path = str(path)
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        col = _Collector(path)
        if _too_big(len(data), col):
            raise RulesError(col.problems)
        decoded = _decode(data, col)
        if decoded is None:
            raise RulesError(col.problems)
        text = decoded
    if not isinstance(text, str):
        raise RulesError([RuleProblem(path, 1, 1, f"rules must be text, not {type(text).__name__}")])
    return _build(text, path, strict_units)


def check_access(path: str) -> None:
    """Refuse a rules file that someone other than root could have written (as sudo does with
    sudoers): it decides how every flow on the server is paced. Raises FlowpacerError."""
    import stat as st
    try:
        info = os.stat(path)
    except OSError as e:
        raise FlowpacerError(f"{path}: cannot read: {e.strerror}") from None
    if not st.S_ISREG(info.st_mode):
        raise FlowpacerError(f"{path}: not a regular file")
    if info.st_uid != 0:
        raise FlowpacerError(f"{path}: owned by uid {info.st_uid}, not root: refusing it "
                             "(chown root)")
    if info.st_mode & (st.S_IWGRP | st.S_IWOTH):
        raise FlowpacerError(f"{path}: writable by group or others (mode "
                             f"{st.S_IMODE(info.st_mode):04o}): refusing it (chmod go-w)")


def access_problem(path: str) -> Optional[str]:
    """Why the daemon would refuse ``path`` for its owner or mode (``check_access``), None
    when it would not: ``rules check`` says so too."""
    try:
        check_access(path)
    except FlowpacerError as e:
        return str(e)
    return None


def load_checked(path: str, strict_units: bool = False) -> RuleSet:
    """The daemon's loader: ``check_access``, then ``load``; the rule set's warnings (e.g. total
    rates oversubscribing the link, issue 15) are logged."""
    check_access(path)
    rs = load(path, strict_units)
    for w in rs.warnings:
        log.warning("%s", w, extra={"FLOWPACER_RULES_FILE": path, "FLOWPACER_LINE": w.line})
    return rs


def load(path, strict_units: bool = False) -> RuleSet:
    """Read and validate a rules file -> ``RuleSet`` (``.path`` is ``path``).
    An unreadable file is one problem ``FILE:0:0: cannot read: reason``."""
    spath = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        reason = e.strerror or str(e)
        raise RulesError([RuleProblem(spath, 0, 0, f"cannot read: {reason}")]) from None
    except ValueError as e:   # e.g. an embedded NUL in the path
        raise RulesError([RuleProblem(spath, 0, 0, f"cannot read: {e}")]) from None
    return loads(data, spath, strict_units)


def _one_or_list(values: List[Any]) -> Any:
    return values[0] if len(values) == 1 else list(values)


def _ports_out(ps: PortSet) -> Any:
    return _one_or_list([lo if lo == hi else f"{lo}-{hi}" for lo, hi in ps.ranges])


def _match_out(m: Match) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if m.process:
        out["process"] = _one_or_list(list(m.process))
    if m.exe:
        out["exe"] = _one_or_list(list(m.exe))
    if m.user:
        out["user"] = _one_or_list([int(u) for u in m.user])
    if m.direction != Direction.ANY:
        out["direction"] = Direction(m.direction).value
    if m.local_port.ranges:
        out["local_port"] = _ports_out(m.local_port)
    if m.remote_port.ranges:
        out["remote_port"] = _ports_out(m.remote_port)
    if m.remote:
        out["remote"] = _one_or_list([str(n) for n in m.remote])
    if m.protocol != Protocol.TCP:
        out["protocol"] = Protocol(m.protocol).value
    return out


def dump(rs: RuleSet) -> str:
    """YAML text that ``loads`` back to a RuleSet equal to ``rs`` except for the
    provenance fields (``path``, each ``Rule.line``): compare with
    ``without_provenance``.  Rates are written exactly ("8mbit", else "NNNbps");
    users as uids.  A RuleSet that ``load`` would refuse dumps to a file it refuses."""
    doc: Dict[str, Any] = {}
    if rs.interface:
        doc["interface"] = rs.interface
    doc["backend"] = BackendKind(rs.backend).value
    if rs.link_rate_bps is not None:
        doc["link_rate"] = units.format_rate(rs.link_rate_bps)
    if rs.interfaces:
        doc["interfaces"] = [i.name if i.link_rate_bps is None else
                             {"name": i.name, "link_rate": units.format_rate(i.link_rate_bps)}
                             for i in rs.interfaces]
    if rs.ready_classes:
        doc["ready_classes"] = rs.ready_classes
    rules = []
    for r in rs.rules:
        d: Dict[str, Any] = {"name": r.name, "match": _match_out(r.match)}
        if r.rate_bps is not None:
            d["rate"] = units.format_rate(r.rate_bps)
        if r.ceil_bps is not None:
            d["ceil"] = units.format_rate(r.ceil_bps)
        if r.receive_rate_bps is not None:
            d["receive_rate"] = units.format_rate(r.receive_rate_bps)
        if r.receive_ceil_bps is not None:
            d["receive_ceil"] = units.format_rate(r.receive_ceil_bps)
        if r.client_rate_bps is not None:
            d["client_rate"] = units.format_rate(r.client_rate_bps)
        if r.total_rate_bps is not None:
            d["total_rate"] = units.format_rate(r.total_rate_bps)
        if tuple(r.client_prefix) != DEFAULT_CLIENT_PREFIX:
            d["client_prefix"] = {"ipv4": int(r.client_prefix[0]), "ipv6": int(r.client_prefix[1])}
        if r.idle_timeout_ns != DEFAULT_IDLE_TIMEOUT_NS:
            d["idle_timeout"] = _duration_out(r.idle_timeout_ns)
        rules.append(d)
    doc["rules"] = rules
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=1000)


def _duration_out(ns: int) -> str:
    """A duration ``_p_idle_timeout`` reads back exactly."""
    if ns % 1_000_000_000 == 0:
        return f"{ns // 1_000_000_000}s"
    if ns % 1_000_000 == 0:
        return f"{ns // 1_000_000}ms"
    return f"{ns}ns"


def without_provenance(rs: RuleSet) -> RuleSet:
    """``rs`` with ``path`` "" and every ``Rule.line`` 0: what to compare when only
    the rules' meaning matters (reload, round trips)."""
    return dataclasses.replace(
        rs, path="", rules=tuple(dataclasses.replace(r, line=0) for r in rs.rules))


def _match_summary(m: Match) -> str:
    parts = []
    if m.process:
        parts.append("process=" + ",".join(m.process))
    if m.exe:
        parts.append("exe=" + ",".join(m.exe))
    if m.user:
        parts.append("user=" + ",".join(_user_name(u) for u in m.user))
    if m.direction != Direction.ANY:
        parts.append("direction=" + Direction(m.direction).value)
    for name, ps in (("local_port", m.local_port), ("remote_port", m.remote_port)):
        if ps.ranges:
            parts.append(name + "=" + ",".join(str(lo) if lo == hi else f"{lo}-{hi}"
                                               for lo, hi in ps.ranges))
    if m.remote:
        parts.append("remote=" + ",".join(str(n) for n in m.remote))
    if m.protocol != Protocol.TCP:
        parts.append("protocol=" + Protocol(m.protocol).value)
    return " ".join(parts) if parts else "(everything)"


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name}({uid})"
    except (KeyError, OverflowError, ValueError):
        return str(uid)


def describe(rs: RuleSet) -> List[str]:
    """Lines for ``flowpacer rules check FILE``: the settings, then each rule with
    its resolved per-flow rate and ceil in bit/s and what it matches."""
    lines = [
        (f"interface: {rs.interface or '(not set: give --interface)'}" if not rs.interfaces
         else "interfaces: " + ", ".join(
             i.name + (f" ({units.format_bits(i.link_rate_bps)})" if i.link_rate_bps else "")
             for i in rs.interfaces) + " (each flow on the interface it leaves by)"),
        f"backend: {BackendKind(rs.backend).value}",
        "link_rate: " + (units.format_bits(rs.link_rate_bps) if rs.link_rate_bps is not None
                         else "(from the interface's speed)"),
        f"rules: {len(rs.rules)} (first match wins; unmatched flows are not shaped)",
    ]
    if rs.ready_classes:
        lines.insert(3, f"ready_classes: {rs.ready_classes} (classes made ahead for a flash "
                        "crowd; htb)")
    for i, r in enumerate(rs.rules, 1):
        ceil = units.format_bits(r.ceil_bps) if r.ceil_bps is not None else "none"
        at = f" (line {r.line})" if r.line else ""
        send = (f"rate {units.format_bits(r.rate_bps)} per flow, ceil {ceil}" if r.sends
                else "receive only (sending not shaped)")
        lines.append(f"  {i}. {r.name}{at}: {send}{_aggregates_summary(r)}; "
                     f"match {_match_summary(r.match)}")
    lines.extend(str(w) for w in rs.warnings)     # "FILE:LINE:COL: ...: warning: ..."
    return lines


def _aggregates_summary(r: Rule) -> str:
    out = ""
    if r.receive_rate_bps is not None:
        rc = units.format_bits(r.receive_ceil_bps) if r.receive_ceil_bps is not None else "none"
        out += f", receive_rate {units.format_bits(r.receive_rate_bps)} per flow (ceil {rc})"
    if r.client_rate_bps is not None:
        v4, v6 = r.client_prefix
        out += (f", client_rate {units.format_bits(r.client_rate_bps)} per client "
                f"(/{v4} IPv4, /{v6} IPv6)")
    if r.total_rate_bps is not None:
        out += f", total_rate {units.format_bits(r.total_rate_bps)}"
    if r.match.protocol != Protocol.TCP and r.idle_timeout_ns != DEFAULT_IDLE_TIMEOUT_NS:
        out += f", idle_timeout {_duration_out(r.idle_timeout_ns)}"
    return out


_SECTIONS = (("top level", TOP_FIELDS), ("rule", RULE_FIELDS), ("match", MATCH_FIELDS),
             ("client_prefix", CLIENT_PREFIX_FIELDS))


def field_docs() -> List[Tuple[str, str, str, str, str]]:
    """(section, field, default, doc, example) for every declared field: the docs' source."""
    out = []
    for section, fields in _SECTIONS:
        for f in fields:
            if f.required:
                default = "required"
            elif f.default_doc:
                default = f.default_doc
            elif isinstance(f.default, (BackendKind, Direction, Protocol)):
                default = f.default.value
            else:
                default = repr(f.default)
            out.append((section, f.name, default, f.doc, f.example))
    return out


def fields_markdown() -> str:
    """The field tables of docs/rules.md, generated from the declarations
    (``python -m flowpacer.policy.rules`` prints them; a test keeps the docs in sync)."""
    parts = []
    for section, _ in _SECTIONS:
        parts.append(f"#### {section} fields\n\n| field | default | meaning | example |\n"
                     "|---|---|---|---|")
        for sec, name, default, doc, example in field_docs():
            if sec == section:
                cells = [f"`{name}`", default, doc, f"`{example}`" if example else ""]
                parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":   # pragma: no cover
    print(fields_markdown(), end="")


__all__ = ["load", "loads", "dump", "describe", "without_provenance", "field_docs",
           "fields_markdown", "Field", "TOP_FIELDS", "RULE_FIELDS", "MATCH_FIELDS", "MAX_BYTES"]
