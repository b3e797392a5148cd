"""One policy (issue 25 item 1): the first-byte program decides a flow's rule at the handshake
only as the engine would.

Pure: every ``Match`` field declares what the kernel can decide of it, and the masks follow.
Kernel (root): the real ``first_rule()`` of ``flowpacer/sources/bpf/firstbyte.c`` (its test build,
run with ``BPF_PROG_TEST_RUN``) on random rule sets and sockets, its maps written by
``FirstByte``'s own code, against ``engine.first_match``: whenever the kernel claims a rule it
is the engine's, it claims whenever everything up to the engine's rule is decided in the kernel,
and when it declines its reason is one the rules give; the addresses it reads from a socket are
``FlowKey.wire``'s (IPv4, IPv6, IPv4-mapped)."""
from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import os
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flowpacer.policy import engine, handshake
from flowpacer.sources import firstbyte
from flowpacer.model import (Direction, Flow, FlowKey, Handshake, Match, PortSet, ProcessInfo,
                             Protocol, Rule, RuleSet, handshake_of)

from harness.bpfrun import run_once

A = ipaddress.ip_address
N = ipaddress.ip_network


def rule(name, rate=125_000, **m):
    return Rule(name, Match(**m), rate)


def bits(mask):
    return {i for i in range(64) if mask >> i & 1}


# ------------------------------------------------------------------ pure

def test_every_match_field_declares_what_the_kernel_decides():
    """Adding a field to Match without an answer fails here (and handshake.py's import)."""
    for f in dataclasses.fields(Match):
        d = handshake_of(f)
        assert d is not None, f"Match.{f.name} declares nothing for the handshake"
        assert isinstance(d.decides, Handshake) and d.why.strip(), f.name
        # a field the kernel (partly) decides is compiled into masks; one it does not has no
        # compiler: the rule is left to user space
        assert (f.name in handshake.FIELD_COMPILERS) == (d.decides is not Handshake.NO), f.name
    assert set(handshake.FIELD_COMPILERS) <= {f.name for f in dataclasses.fields(Match)}


def test_the_masks_have_the_programs_sizes():
    """handshake.py (policy) and firstbyte.py (the program's owner) both mirror firstbyte.h."""
    assert (handshake.COMM_LEN, handshake.MAX_RULES) == (firstbyte.COMM_LEN, firstbyte.MAX_RULES)
    with open(os.path.join(firstbyte.BPF_DIR, "firstbyte.h")) as f:
        h = f.read()
    assert f"#define FB_COMM_LEN   {handshake.COMM_LEN}\n" in h
    assert f"#define FB_MAX_RULES  {handshake.MAX_RULES} " in h


def test_a_field_without_a_declaration_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        process: tuple = dataclasses.field(default=(), metadata=dataclasses.fields(Match)[0]
                                           .metadata)
        tos: int = 0

    with pytest.raises(TypeError, match="Undeclared.tos does not declare"):
        handshake._declarations(Undeclared)


def test_a_field_declared_no_leaves_its_rules_to_user_space():
    rs = RuleSet("eth0", rules=(rule("e", exe=("/usr/bin/x",)),
                                rule("p", local_port=PortSet(((80, 80),)))))
    c = handshake.compile_rules(rs)
    assert "exe" in c.not_kernel["e"] and set(c.kernel) == {1}
    # still a candidate of every flow (the walk stops there: undecided)
    assert {0} <= bits(c.inbound & c.outbound & c.any_comm & c.any_uid & c.any_remote
                       & c.lport[443] & c.rport[443])


def test_a_udp_rule_is_never_a_candidate_for_a_tcp_handshake():
    """The bug this fixes: a udp rule before a tcp rule took the tcp flows' kernel claims."""
    rs = RuleSet("eth0", rules=(rule("u", process=("musicd",), protocol=Protocol.UDP),
                                rule("t", process=("musicd",)),
                                rule("a", user=(33,), protocol=Protocol.ANY)))
    c = handshake.compile_rules(rs)
    assert not (c.inbound | c.outbound) & 1 and c.never == 1
    assert {i: r.name for i, r in c.kernel.items()} == {1: "t", 2: "a"}
    assert "udp" in c.not_kernel["u"]


def test_past_the_kernels_rules_one_bit_stands_for_the_rest():
    far = tuple(rule(f"r{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(70))
    c = handshake.compile_rules(RuleSet("eth0", rules=far))
    assert set(c.kernel) == set(range(63))
    assert all(f"r{i}" in c.not_kernel for i in range(63, 70))
    assert c.lport[5] == 1 << 63 and c.lport[1000] == 1 | 1 << 63
    assert 63 in bits(c.live & c.inbound & c.outbound & c.any_comm & c.any_uid & c.any_remote)
    assert not c.kernel_mask >> 63
    c64 = handshake.compile_rules(RuleSet("eth0", rules=far[:64]))
    assert set(c64.kernel) == set(range(64))


def test_process_names_the_kernel_cannot_compare_are_left_to_user_space():
    rs = RuleSet("eth0", rules=(rule("g", process=("mus*",)), rule("f", process=("ab\ufffd",)),
                                rule("l", process=("a" * 16,)), rule("ok", process=("a" * 15,))))
    c = handshake.compile_rules(rs)
    assert "glob" in c.not_kernel["g"] and "U+FFFD" in c.not_kernel["f"]
    assert bits(c.any_comm) == {0, 1}
    assert c.never == 1 << 2                     # no comm is 16 bytes
    assert c.comms == {b"a" * 15 + b"\0": 1 << 3}


def test_port_masks_merge_overlapping_and_adjacent_ranges():
    rs = RuleSet("eth0", rules=(rule("a", local_port=PortSet(((10, 20), (15, 30), (31, 31),
                                                              (40, 40)))),
                                rule("b", local_port=PortSet(((0, 0), (65535, 65535)))),
                                rule("c")))
    m = handshake.compile_rules(rs).lport
    want = {p: 4 | (1 if 10 <= p <= 31 or p == 40 else 0) | (2 if p in (0, 65535) else 0)
            for p in range(65536)}
    assert m == [want[p] for p in range(65536)]


# ------------------------------------------------------------------ kernel

# why the program declines a flow: its counters (firstbyte.h FB_C_*)
REASONS = {firstbyte.COUNTERS.index(name): why for name, why in (
    ("undecided", "undecided"), ("unattributed", "unattributed"), ("no_match", "no match"))}


class Kernel:
    """The test build of firstbyte.c: FirstByte's map writers fill it, one socket at a time
    goes through the real first_rule()."""

    def __init__(self):
        import bcc
        self.b = bcc.BPF(src_file=firstbyte.BPF_SRC.encode(),
                         cflags=[f"-I{firstbyte.BPF_DIR}", "-DFB_TEST_RUN"])
        self.fn = self.b.load_func(b"fb_test_first_rule", bcc.BPF.RAW_TRACEPOINT)
        self.fb = firstbyte.FirstByte()
        self.fb._bpf = self.b            # the maps are written by FirstByte's own code
        self.fb.netns_cookie = 1
        self.counters = self.b[b"fb_counters"]
        self.tin = self.b[b"fb_test_in"]
        self.tout = self.b[b"fb_test_out"]

    def load(self, c):
        self.fb._write_rules(c)
        self.fb._write_config(c.live, c)

    def _count(self, i):
        return sum(self.counters[ctypes.c_int(i)])

    def run(self, sock):
        """(rule index or -1, why declined or None, (family, laddr, raddr) as the program saw)"""
        leaf = self.tin.Leaf()
        leaf.family, leaf.lport, leaf.rport = sock.family, sock.lport, sock.rport
        leaf.direction = (firstbyte.FB_DIR_INBOUND if sock.direction is Direction.INBOUND
                          else firstbyte.FB_DIR_OUTBOUND)
        leaf.attributed, leaf.uid = int(sock.attributed), sock.uid
        if sock.family == socket.AF_INET:
            leaf.local_ip4 = int.from_bytes(sock.local.packed, "little")
            leaf.remote_ip4 = int.from_bytes(sock.remote.packed, "little")
        else:
            for i in range(4):
                leaf.local_ip6[i] = int.from_bytes(sock.local.packed[4 * i:4 * i + 4], "little")
                leaf.remote_ip6[i] = int.from_bytes(sock.remote.packed[4 * i:4 * i + 4], "little")
        ctypes.memmove(ctypes.addressof(leaf) + type(leaf).comm.offset, sock.comm_bytes,
                       len(sock.comm_bytes))
        self.tin[ctypes.c_int(0)] = leaf
        before = {i: self._count(i) for i in REASONS}
        assert run_once(self.fn.fd) == 0
        after = {i: self._count(i) for i in REASONS}
        out = self.tout[ctypes.c_int(0)]
        assert out.live
        why = [REASONS[i] for i in REASONS if after[i] != before[i]]
        assert len(why) == (0 if out.rule >= 0 else 1), why
        ev = out.ev
        n = 4 if ev.family == 4 else 16
        return (out.rule, why[0] if why else None,
                (ev.family, bytes(ev.laddr)[:n], bytes(ev.raddr)[:n]))

    def close(self):
        self.b.cleanup()


@pytest.fixture(scope="module")
def kernel(root):
    k = Kernel()
    yield k
    k.close()


@dataclasses.dataclass(frozen=True)
class Sock:
    """A TCP socket at the end of its handshake, as sock_ops sees it."""
    family: int                       # AF_INET / AF_INET6
    local: object
    remote: object
    lport: int
    rport: int
    direction: Direction
    attributed: bool
    uid: int
    name: str                         # the owner's process name (may be longer than a comm)
    exe: str

    @property
    def comm_bytes(self) -> bytes:    # what the kernel holds: 15 bytes at most
        return self.name.encode()[:15]

    def flow(self) -> Flow:
        """The flow as user space gives it to the engine: FlowKey.wire, the comm decoded as
        the tracer does, the owner known (user space always learns it)."""
        key = FlowKey.wire(self.local, self.lport, self.remote, self.rport)
        comm = self.comm_bytes.decode("utf-8", "replace")
        return Flow(key, self.direction, ProcessInfo(pid=4242, comm=comm, exe=self.exe,
                                                     uid=self.uid))


# values drawn from small pools, so that rules and flows meet often
NAMES = ["musicd", "nginx", "a", "fp-burst-srv", "very-long-process-name",    # > 15 bytes
         "caf\u00e9-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9x"]   # cut inside a character at 15
UIDS = [0, 33, 1000, 2 ** 32 - 2]
PORTS = [1, 80, 443, 8000, 8001, 8443, 40000, 65535]
NETS = ["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32", "0.0.0.0/0",
        "192.0.2.0/24", "2001:db8::/32", "2001:db8:1::/48", "::/0", "fd00::/8",
        "::ffff:0:0/96", "::ffff:10.0.0.0/104"]
V4 = ["10.1.2.3", "10.1.9.9", "10.200.0.1", "192.0.2.7", "203.0.113.5"]
V6 = ["2001:db8:1::5", "2001:db8:2::1", "fd00::1", "2001:db9::1", "::ffff:0:1"]


def comm_of(name):
    return name.encode()[:15].decode("utf-8", "replace")


patterns = st.one_of(
    st.sampled_from(NAMES + [comm_of(n) for n in NAMES]
                    + ["mus*", "*d", "?", "ngin?", "[mn]*", "*", "caf*", "a[b"]),
    st.text("abmnd\u00e9\ufffd*?[]", min_size=1, max_size=17))
ports = st.one_of(st.sampled_from(PORTS), st.integers(0, 65535))
port_sets = st.lists(st.tuples(ports, ports).map(lambda t: (min(t), max(t))),
                     max_size=3).map(lambda rs: PortSet(tuple(rs)))


@st.composite
def networks(draw):
    if draw(st.booleans()):
        return N(draw(st.sampled_from(NETS)))
    v6 = draw(st.booleans())
    addr = draw(st.ip_addresses(v=6 if v6 else 4))
    return ipaddress.ip_network((addr, draw(st.integers(0, 128 if v6 else 32))), strict=False)


def tuples_of(s, max_size=2):
    return st.lists(s, max_size=max_size).map(tuple)


def sometimes(values, default):
    """Mostly the field's default ("any"), so that rules match flows often."""
    return st.one_of(st.just(default), st.just(default), values)


matches = st.builds(
    Match,
    process=st.one_of(st.just(()), tuples_of(patterns)),
    exe=sometimes(tuples_of(st.sampled_from(["/usr/bin/*", "/opt/x"]), 1), ()),
    user=sometimes(tuples_of(st.sampled_from(UIDS)), ()),
    direction=st.sampled_from(list(Direction)),
    local_port=sometimes(port_sets, PortSet()),
    remote_port=sometimes(port_sets, PortSet()),
    remote=sometimes(tuples_of(networks(), 3), ()),
    protocol=st.sampled_from(list(Protocol)))


@st.composite
def rule_sets(draw):
    n = draw(st.integers(1, 8))
    rules = []
    for i in range(n):
        kind = draw(st.sampled_from(["plain"] * 5 + ["receive-only", "client", "total", "both"]))
        rate = None if kind == "receive-only" else 125_000
        rules.append(Rule(f"r{i}", draw(matches), rate,
                          client_rate_bps=250_000 if kind == "client" else None,
                          total_rate_bps=1_000_000 if kind == "total" else None,
                          receive_rate_bps=62_500 if kind in ("receive-only", "both") else None))
    # sometimes push the drawn rules past what the kernel sees (one bit for the rest)
    pad = draw(st.sampled_from([0] * 6 + [58, 62]))
    filler = tuple(Rule(f"pad{i}", Match(process=("zz-filler",)), 125_000) for i in range(pad))
    return RuleSet("eth0", rules=filler + tuple(rules))


def _in(net, draw):
    """An address inside ``net`` (its first, last or a random one)."""
    off = draw(st.sampled_from([0, net.num_addresses - 1, None]))
    if off is None:
        off = draw(st.integers(0, net.num_addresses - 1))
    return net.network_address + off


@st.composite
def socks(draw, rs):
    """A socket, its values often taken from the rules' own (so that they meet)."""
    m = [r.match for r in rs.rules]
    nets = [n for x in m for n in x.remote]
    hint_ports = [p for x in m for ps in (x.local_port, x.remote_port) for lo, hi in ps.ranges
                  for p in (lo, hi, (lo + hi) // 2)]
    # a rule's literal name is the comm of itself, or of a longer name the kernel cuts to it
    literal = {p for x in m for p in x.process if not engine.is_glob(p)}
    hint_names = sorted(literal | {n for n in NAMES if comm_of(n) in literal})
    hint_uids = [u for x in m for u in x.user]

    def pick(pool, hints):
        return draw(st.sampled_from(hints if hints and draw(st.booleans()) else pool))

    port = st.one_of(ports, st.sampled_from(hint_ports)) if hint_ports else ports

    def address(v):
        mine = [n for n in nets if n.version == v]
        how = draw(st.sampled_from(["pool", "random"] + ["rule"] * 2 * bool(mine)))
        if how == "pool":
            return A(draw(st.sampled_from(V4 if v == 4 else V6)))
        if how == "random":
            return draw(st.ip_addresses(v=v))
        return _in(draw(st.sampled_from(mine)), draw)

    kind = draw(st.sampled_from(["v4", "v6", "mapped", "half-mapped"]))
    if kind == "v4":
        fam, local, remote = socket.AF_INET, A("198.51.100.1"), address(4)
    elif kind == "v6":
        fam, local, remote = socket.AF_INET6, A("2001:db8:ffff::1"), address(6)
    else:
        mapped = A(f"::ffff:{address(4)}")
        fam = socket.AF_INET6
        if kind == "mapped":               # a dual-stack socket talking IPv4
            local, remote = A("::ffff:198.51.100.1"), mapped
        else:                              # only the peer looks mapped: IPv6 on the wire
            local, remote = A("2001:db8:ffff::1"), mapped
    return Sock(fam, local, remote, draw(port), draw(port),
                draw(st.sampled_from([Direction.INBOUND, Direction.OUTBOUND])),
                draw(st.booleans()) or draw(st.booleans()), pick(UIDS, hint_uids),
                pick(NAMES, hint_names), draw(st.sampled_from(["/usr/bin/musicd", ""])))


def check(kernel, rs, c, sock):
    """One socket through the real first_rule(), against engine.first_match; the kernel's
    answer (rule index or -1, why declined)."""
    rules = rs.rules
    seen = len(rules) if len(rules) <= handshake.MAX_RULES else handshake.MAX_RULES - 1
    never = bits(c.never)
    decided = set(c.kernel) | never                 # the kernel knows whether these match
    flow = sock.flow()
    got, why, wire = kernel.run(sock)
    key = flow.key
    # the program read the socket's addresses as FlowKey.wire does
    assert wire == (key.family, key.local_addr.packed, key.remote_addr.packed), sock
    want = engine.first_match(rules, flow)
    idx = None if want is None else rules.index(want)
    upto = range(len(rules)) if idx is None else range(idx + 1)
    if sock.attributed:      # flowpacer explain's "first byte" says what the kernel does
        assert handshake.first_byte(rs, flow, c)[0] is (got >= 0), (sock, got, why)
    if got >= 0:
        # a claim is only ever the engine's rule, and a rule the kernel decides wholly
        assert got == idx and got in c.kernel, (sock, got, idx)
        return got, why
    # declined: for a reason the rules up to the engine's give
    if why == "no match":
        assert idx is None, (sock, idx)
    elif why == "unattributed":
        assert not sock.attributed and any(
            (rules[i].match.process or rules[i].match.user) and i not in never
            for i in upto if i < seen), (sock, idx)
    else:
        assert any(i >= seen or i not in decided for i in upto), (sock, idx)
    # and never when the kernel sees and decides everything up to the engine's rule
    owner_free = all(not (rules[i].match.process or rules[i].match.user)
                     for i in upto if i not in never)
    if all(i < seen and i in decided for i in upto) and (sock.attributed or owner_free):
        assert idx is None and why == "no match", (sock, idx, why)
    return got, why


def sock(remote="10.1.2.3", local=None, lport=8443, rport=40000, inbound=True, attributed=True,
         uid=1000, name="musicd"):
    r = A(remote)
    fam = socket.AF_INET if r.version == 4 else socket.AF_INET6
    if local is None:
        local = "198.51.100.1" if r.version == 4 else \
            "::ffff:198.51.100.1" if r.ipv4_mapped else "2001:db8:ffff::1"
    return Sock(fam, A(local), r, lport, rport,
                Direction.INBOUND if inbound else Direction.OUTBOUND, attributed, uid, name,
                "/usr/bin/musicd")


CUT = NAMES[5]                          # its comm ends in a character cut in two


FIXED_CASES = [
    # the bug: a udp rule first took the tcp flows of the rule after it
    ([rule("u", process=("musicd",), protocol=Protocol.UDP), rule("t", process=("musicd",))],
     sock(), (1, None)),
    ([rule("any", user=(1000,), protocol=Protocol.ANY)], sock(), (0, None)),
    # U+FFFD: user space compares it, the kernel cannot
    ([rule("cut", process=(comm_of(CUT),)), rule("all", local_port=PortSet(((1, 65535),)))],
     sock(name=CUT), (-1, "undecided")),
    ([rule("cut", process=(comm_of(CUT),)), rule("all", local_port=PortSet(((1, 65535),)))],
     sock(name="musicd"), (-1, "undecided")),
    ([rule("cut", process=(comm_of(CUT),), local_port=PortSet(((80, 80),))), rule("x")],
     sock(name=CUT), (1, None)),
    # names as long as a comm, and longer (the kernel cut the owner's name)
    ([rule("15", process=("very-long-proc",)), rule("x", user=(1000,))],
     sock(name="very-long-process-name"), (1, None)),
    ([rule("15", process=("very-long-proce",))], sock(name="very-long-process-name"), (0, None)),
    # globs and exe stop the walk; receive-only and aggregate rules too
    ([rule("g", process=("mus*",)), rule("p", local_port=PortSet(((8443, 8443),)))], sock(),
     (-1, "undecided")),
    ([rule("g", process=("mus*",), local_port=PortSet(((80, 80),))),
      rule("p", local_port=PortSet(((8443, 8443),)))], sock(), (1, None)),
    ([rule("e", exe=("/opt/*",)), rule("p", local_port=PortSet(((8443, 8443),)))], sock(),
     (-1, "undecided")),
    ([Rule("ro", Match(process=("musicd",)), None, receive_rate_bps=1000), rule("p")], sock(),
     (-1, "undecided")),
    ([Rule("agg", Match(process=("musicd",)), 1000, client_rate_bps=2000), rule("p")], sock(),
     (-1, "undecided")),
    # the owner is unknown: a rule that needs it stops the walk, an owner-free one claims
    ([rule("n", process=("musicd",)), rule("p", local_port=PortSet(((8443, 8443),)))],
     sock(attributed=False), (-1, "unattributed")),
    ([rule("p", local_port=PortSet(((8443, 8443),))), rule("n", process=("musicd",))],
     sock(attributed=False), (0, None)),
    # nested prefixes: the longest holds the shorter ones' rules
    ([rule("16", remote=(N("10.1.0.0/16"),), user=(5,)), rule("8", remote=(N("10.0.0.0/8"),))],
     sock(), (1, None)),
    ([rule("8", remote=(N("10.0.0.0/8"),), user=(5,)), rule("24", remote=(N("10.1.2.0/24"),))],
     sock(), (1, None)),
    # IPv4-mapped sockets are IPv4 (FlowKey.wire); an IPv6 prefix of mapped addresses never
    # matches them, a socket whose local address is not mapped is IPv6
    ([rule("v4", remote=(N("10.0.0.0/8"),))], sock("::ffff:10.1.2.3"), (0, None)),
    ([rule("m", remote=(N("::ffff:0:0/96"),))], sock("::ffff:10.1.2.3"), (-1, "no match")),
    ([rule("m", remote=(N("::ffff:0:0/96"),))], sock("::ffff:10.1.2.3", local="2001:db8::1"),
     (0, None)),
    ([rule("v6", remote=(N("2001:db8::/32"),), direction=Direction.OUTBOUND)],
     sock("2001:db8:1::5", inbound=False), (0, None)),
    ([rule("in", direction=Direction.INBOUND, user=(1000,))], sock(inbound=False),
     (-1, "no match")),
    # past the rules the kernel sees: one bit stands for them, undecided (not "no match")
    ([rule(f"p{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(70)],
     sock(lport=1066), (-1, "undecided")),
    ([rule(f"p{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(70)],
     sock(lport=1062), (62, None)),
    ([rule(f"p{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(70)],
     sock(lport=999), (-1, "undecided")),
    ([rule(f"p{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(64)],
     sock(lport=1063), (63, None)),
    ([rule(f"p{i}", local_port=PortSet(((1000 + i, 1000 + i),))) for i in range(64)],
     sock(lport=999), (-1, "no match")),
]


@pytest.mark.kernel
@pytest.mark.parametrize("rules, s, want", FIXED_CASES)
def test_the_kernel_on_fixed_cases(kernel, rules, s, want):
    rs = RuleSet("eth0", rules=tuple(rules))
    c = handshake.compile_rules(rs)
    kernel.load(c)
    assert check(kernel, rs, c, s) == want


@pytest.mark.parametrize("rules, s, want", [c for c in FIXED_CASES if c[1].attributed])
def test_explains_first_byte_verdict_is_the_kernels_on_fixed_cases(rules, s, want):
    """``flowpacer explain``'s "first byte" line (handshake.first_byte) says what the real
    program does in the cases above (a socket whose owner the kernel knows)."""
    rs = RuleSet("eth0", rules=tuple(rules))
    yes, why = handshake.first_byte(rs, s.flow())
    got, reason = want
    assert yes is (got >= 0), why
    if got >= 0:
        assert why.startswith(f"rule {rules[got].name!r} is decided in the kernel")
    elif reason == "no match":
        assert why == "no rule matches it"
    else:
        assert "left to user space" in why or "not decided in the kernel" in why, why


EXAMPLES = int(os.environ.get("FP_EXAMPLES", "200"))


@pytest.mark.kernel
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_the_kernel_chooses_the_engines_rule_or_declines_for_a_reason(kernel, data):
    rs = data.draw(rule_sets(), "rules")
    sockets = data.draw(st.lists(socks(rs), min_size=1, max_size=12), "sockets")
    c = handshake.compile_rules(rs)
    kernel.load(c)
    for s in sockets:
        got, why = check(kernel, rs, c, s)
        event(f"kernel: {'claim' if got >= 0 else why}")
