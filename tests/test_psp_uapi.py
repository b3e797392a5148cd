"""flowpacer/kernel/tc/psp.py against the psp uapi header, with a C compiler as the referee.

* Every TCA_PSP_* name, every constant and every field of both statistics structs is read from
  the header text itself (so a field added there and not here fails), compiled with gcc and
  compared with the Python encoding (attribute numbers, nla types, offsets, sizes).
* A C decoder that parses TCA_OPTIONS the way the module does (exact attribute lengths, unknown
  types refused) reads what pyroute2 and the fast packers encode.
* A C encoder writes a dump (options + statistics structs) that pyroute2 decodes with our plugin.
* pyroute2's request pipeline (IPRoute.tc with kind="psp") runs end to end against this kernel,
  which has no psp qdisc and must refuse it with its own message.
"""
from __future__ import annotations

import errno
import json
import os
import re
import struct
import subprocess
import uuid
from pathlib import Path

import pytest

from flowpacer.kernel.tc import psp

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "flowpacer" / "kernel" / "kmod" / "uapi" / "pkt_sch_psp.h"

# linux/rtnetlink.h, linux/gen_stats.h
RTM_NEWQDISC, RTM_NEWTCLASS = 36, 40
TCA_KIND, TCA_OPTIONS, TCA_XSTATS, TCA_STATS2 = 1, 2, 4, 7
TCA_STATS_APP = 4


def header_text() -> str:
    return HEADER.read_text()


def enum_names() -> list:
    body = re.search(r"enum\s*\{(.*?)\};", header_text(), re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return [n for n in re.findall(r"\b(TCA_PSP_\w+)\b", body) if not n.startswith("__")]


def define_names() -> list:
    return re.findall(r"#define\s+(PSP_\w+)\s", header_text())


def struct_fields(name: str) -> list:
    body = re.search(r"struct\s+%s\s*\{(.*?)\};" % name, header_text(), re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return re.findall(r"__([us]\d+)\s+(\w+)\s*;", body)


def compile_c(tmp_path: Path, name: str, source: str) -> Path:
    src = tmp_path / f"{name}.c"
    exe = tmp_path / name
    src.write_text(source)
    p = subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
                        "-I", str(HEADER.parent), "-o", str(exe), str(src)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return exe


def run(exe: Path, *args: str) -> str:
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


# --------------------------------------------------------------- layout parity


def test_header_layout_matches_python(tmp_path):
    enums, defines = enum_names(), define_names()
    structs = {s: struct_fields(s) for s in ("tc_psp_xstats", "tc_psp_class_xstats")}
    assert len(enums) >= 9 and len(defines) >= 8
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "pkt_sch_psp.h"',
             'int main(void) {', 'printf("{\\"enum\\": {");']
    for i, n in enumerate(enums + ["TCA_PSP_MAX"]):
        lines.append('printf("%s\\"%s\\": %%llu", (unsigned long long)%s);'
                     % ("," if i else "", n, n))
    lines.append('printf("}, \\"define\\": {");')
    for i, n in enumerate(defines):
        lines.append('printf("%s\\"%s\\": %%llu", (unsigned long long)(%s));'
                     % ("," if i else "", n, n))
    lines.append('printf("}, \\"struct\\": {");')
    for si, (s, fields) in enumerate(structs.items()):
        lines.append('printf("%s\\"%s\\": {\\"size\\": %%zu, \\"fields\\": [", sizeof(struct %s));'
                     % ("," if si else "", s, s))
        for fi, (_t, f) in enumerate(fields):
            lines.append('printf("%s[\\"%s\\", %%zu, %%zu, %%d]", offsetof(struct %s, %s), '
                         'sizeof(((struct %s *)0)->%s), _Generic(((struct %s *)0)->%s, __s8: 1, __s16: 1, __s32: 1, __s64: 1, default: 0));'
                         % ("," if fi else "", f, s, f, s, f, s, f))
        lines.append('printf("]}");')
    lines += ['printf("}}\\n");', 'return 0; }']
    out = json.loads(run(compile_c(tmp_path, "layout", "\n".join(lines))))

    # attribute numbers: constants and the pyroute2 nla_map (its index is the attribute type)
    names = [n for n, _ in psp.options.nla_map]
    for n, v in out["enum"].items():
        assert getattr(psp, n) == v, n
        if n != "TCA_PSP_MAX":
            assert names[v] == n, f"nla_map[{v}] is {names[v]}, the header says {n}"
    assert len(names) == out["enum"]["TCA_PSP_MAX"] + 1
    # nla types agree with the header's comments (u64/u32)
    nla_types = dict(psp.options.nla_map)
    for n in enums:
        m = re.search(r"\b%s\b,\s*/\*\s*(u64|u32)" % n, header_text())
        if m:
            assert nla_types[n] == {"u64": "uint64", "u32": "uint32"}[m.group(1)], n
    for n, v in out["define"].items():
        assert getattr(psp, n) == v, n

    # statistics structs: pyroute2 fields and our struct.Struct, offset by offset
    for s, py_fields, st in (("tc_psp_xstats", psp.QDISC_XSTATS_FIELDS, psp.QDISC_XSTATS),
                             ("tc_psp_class_xstats", psp.CLASS_XSTATS_FIELDS, psp.CLASS_XSTATS)):
        c = out["struct"][s]
        assert st.size == c["size"], s
        assert [f for f, _ in py_fields] == [f[0] for f in c["fields"]], s
        off = 0
        for (name, fmt), (cname, coff, csize, csigned) in zip(py_fields, c["fields"]):
            assert coff == off, f"{s}.{name}: C offset {coff}, Python {off}"
            assert csize == struct.calcsize("=" + fmt), f"{s}.{name}"
            assert bool(csigned) == fmt.islower(), f"{s}.{name}: signedness"
            off += csize
        assert off == c["size"]
    assert psp.qdisc_xstats.fields == psp.QDISC_XSTATS_FIELDS
    assert psp.class_xstats.fields == psp.CLASS_XSTATS_FIELDS


# ------------------------------------------------------------ C decode / encode

DECODER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include "pkt_sch_psp.h"

/* What the module's policy tables say: attribute sizes, and which side may use them. */
static const struct { const char *name; int size; int qdisc; } pol[TCA_PSP_MAX + 1] = {
	[TCA_PSP_LINK_RATE]	= { "link_rate", 8, 1 },
	[TCA_PSP_DEFCLS]	= { "defcls", 4, 1 },
	[TCA_PSP_OVERHEAD]	= { "overhead", 4, 1 },
	[TCA_PSP_LIMIT]		= { "limit", 4, 1 },
	[TCA_PSP_CLASS_RATE]	= { "class_rate", 8, 0 },
	[TCA_PSP_CLASS_CEIL]	= { "class_ceil", 8, 0 },
	[TCA_PSP_CLASS_LIMIT]	= { "class_limit", 4, 0 },
	[TCA_PSP_CATCHUP]	= { "catchup", 8, 1 },
	[TCA_PSP_CLASS_GROUP]	= { "class_group", 0, 0 },	/* NLA_FLAG: no payload */
};

int main(int argc, char **argv)
{
	size_t n, off = 0, i;
	unsigned char *b;
	int qdisc, first = 1;

	if (argc != 3)
		return 2;
	n = strlen(argv[2]) / 2;
	qdisc = !strcmp(argv[1], "qdisc");
	b = malloc(n + 1);
	if (!b)
		return 2;
	for (i = 0; i < n; i++)
		sscanf(argv[2] + 2 * i, "%2hhx", &b[i]);
	printf("{");
	while (off + 4 <= n) {
		uint16_t len, type;
		uint64_t v = 0;

		memcpy(&len, b + off, 2);
		memcpy(&type, b + off + 2, 2);
		type &= 0x3fff;
		if (len < 4 || off + len > n) { fprintf(stderr, "bad length\n"); return 1; }
		if (type == 0 || type > TCA_PSP_MAX || !pol[type].name) {
			fprintf(stderr, "attribute %u refused\n", type); return 1;
		}
		if (pol[type].qdisc != qdisc) { fprintf(stderr, "%s in %s\n", pol[type].name, argv[1]); return 1; }
		if (len - 4 != pol[type].size) { fprintf(stderr, "%s: %d bytes\n", pol[type].name, len - 4); return 1; }
		memcpy(&v, b + off + 4, pol[type].size);
		if (!pol[type].size)
			v = 1;	/* a flag: present */
		printf("%s\"%s\": %llu", first ? "" : ", ", pol[type].name, (unsigned long long)v);
		first = 0;
		off += (len + 3u) & ~3u;
	}
	printf("}\n");
	return off == n ? 0 : 1;
}
"""

ENCODER = r"""
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include "pkt_sch_psp.h"

static unsigned char buf[4096];
static size_t pos;

static void put(uint16_t type, const void *data, uint16_t len)
{
	uint16_t l = len + 4;

	memcpy(buf + pos, &l, 2);
	memcpy(buf + pos + 2, &type, 2);
	memcpy(buf + pos + 4, data, len);
	memset(buf + pos + 4 + len, 0, ((l + 3u) & ~3u) - l);
	pos += (l + 3u) & ~3u;
}

static void hex(void)
{
	size_t i;

	for (i = 0; i < pos; i++)
		printf("%02x", buf[i]);
	printf("\n");
	pos = 0;
}

int main(void)
{
	uint64_t rate = 1250000, ceil = 2500000, link = 125000000, catchup = 30000000;
	uint32_t limit = 777, defcls = 2, overhead = 24;
	struct tc_psp_xstats q;
	struct tc_psp_class_xstats c;

	put(TCA_PSP_LINK_RATE, &link, 8);
	put(TCA_PSP_DEFCLS, &defcls, 4);
	put(TCA_PSP_OVERHEAD, &overhead, 4);
	put(TCA_PSP_LIMIT, &limit, 4);
	put(TCA_PSP_CATCHUP, &catchup, 8);
	hex();
	put(TCA_PSP_CLASS_RATE, &rate, 8);
	put(TCA_PSP_CLASS_CEIL, &ceil, 8);
	put(TCA_PSP_CLASS_LIMIT, &limit, 4);
	hex();
	put(TCA_PSP_CLASS_RATE, &ceil, 8);
	put(TCA_PSP_CLASS_GROUP, NULL, 0);
	hex();
	memset(&q, 0, sizeof(q));
	q.link_rate = link; q.rate_sum = 3; q.paced_pkts = 4; q.borrowed_pkts = 5;
	q.unpaced_pkts = 6; q.late_ns_total = 7; q.late_ns_max = 8; q.clamps = 9;
	q.timer_fires = 10; q.timer_late_ns_max = 11; q.gso_split = 12; q.longest_run = 15;
	q.classes = 13; q.active = 14;
	memcpy(buf, &q, sizeof(q)); pos = sizeof(q); hex();
	memset(&c, 0, sizeof(c));
	c.rate = rate; c.ceil = ceil; c.eff_rate = 21; c.rate_est = 22; c.borrowed_bytes = 23;
	c.borrowed_pkts = 24; c.clamps = 25; c.late_ns_max = 26; c.clock_ns = -27; c.limit = limit;
	c.flags = PSP_CLASS_F_DEFAULT | PSP_CLASS_F_ACTIVE;
	c.group_sum = 28; c.group_held = 29; c.members = 30;
	memcpy(buf, &c, sizeof(c)); pos = sizeof(c); hex();
	return 0;
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return compile_c(tmp_path_factory.mktemp("psp_dec"), "decoder", DECODER)


NLA_F_NESTED = 0x8000


def options_payload(tc_bytes: bytes) -> bytes:
    """The TCA_OPTIONS payload of TCA_KIND + TCA_OPTIONS bytes from the packers.

    The module parses TCA_OPTIONS with nla_parse_nested(), which refuses a container without
    NLA_F_NESTED ("NLA_F_NESTED is missing"): check it here too.
    """
    off = 0
    while off < len(tc_bytes):
        alen, atype = struct.unpack_from("=HH", tc_bytes, off)
        if atype & 0x3FFF == TCA_OPTIONS:
            assert atype & NLA_F_NESTED, "TCA_OPTIONS without NLA_F_NESTED: the module refuses it"
            return tc_bytes[off + 4: off + alen]
        off += (alen + 3) & ~3
    raise AssertionError("no TCA_OPTIONS")


def pyroute2_options_payload(kind: str, params: dict, msg_type: int) -> bytes:
    from pyroute2.netlink.rtnl.tcmsg import tcmsg
    psp.register()
    m = tcmsg()
    m["header"]["type"] = msg_type
    m["attrs"] = [["TCA_KIND", kind], ["TCA_OPTIONS", params]]
    m.encode()
    raw = bytes(m.data[:m["header"]["length"]])
    return options_payload(raw[16 + 20:])


def decode(decoder, side: str, payload: bytes) -> dict:
    return json.loads(run(decoder, side, payload.hex()))


def test_pyroute2_encoding_reads_back_in_c(decoder):
    q = psp.get_parameters(dict(link_rate=(1 << 40), default="f1f0:7", overhead=24, limit=5000,
                                catchup=999_999_937))
    assert decode(decoder, "qdisc", pyroute2_options_payload("psp", q, RTM_NEWQDISC)) == \
        dict(link_rate=1 << 40, defcls=7, overhead=24, limit=5000, catchup=999_999_937)
    c = psp.get_class_parameters(dict(rate=1_250_000, ceil=(1 << 33) + 5, limit=64))
    assert decode(decoder, "class", pyroute2_options_payload("psp", c, RTM_NEWTCLASS)) == \
        dict(class_rate=1_250_000, class_ceil=(1 << 33) + 5, class_limit=64)
    g = psp.get_class_parameters(dict(rate=2_500_000, group=True))
    assert decode(decoder, "class", pyroute2_options_payload("psp", g, RTM_NEWTCLASS)) == \
        dict(class_rate=2_500_000, class_group=1)


def test_fast_packers_read_back_in_c(decoder):
    b = psp.qdisc_options(125_000_000, 2, overhead_bytes=24, limit=100, catchup_ns=0)
    assert b.startswith(b"\x08\x00\x01\x00psp\x00")
    assert decode(decoder, "qdisc", options_payload(b)) == \
        dict(link_rate=125_000_000, defcls=2, overhead=24, limit=100, catchup=0)
    assert decode(decoder, "qdisc", options_payload(psp.qdisc_options(None, 0xF1F00002))) == \
        dict(defcls=2)
    assert decode(decoder, "class", options_payload(psp.class_options(1000, 1000))) == \
        dict(class_rate=1000)
    assert decode(decoder, "class", options_payload(psp.class_options(5, 9, limit=3))) == \
        dict(class_rate=5, class_ceil=9, class_limit=3)
    assert decode(decoder, "class", options_payload(psp.default_class_options(42))) == \
        dict(class_limit=42)
    assert decode(decoder, "class", options_payload(psp.group_options(2_500_000))) == \
        dict(class_rate=2_500_000, class_group=1)
    est = psp.class_options(1000, estimator=(0, 3))
    assert est[-8:] == struct.pack("=HHbB", 6, psp.TCA_RATE, 0, 3) + b"\0\0"


def test_c_encoded_dump_decodes_in_pyroute2(tmp_path):
    from pyroute2.netlink.rtnl.tcmsg import tcmsg
    psp.register()
    qopt, copt, gopt, qxs, cxs = (bytes.fromhex(x) for x in
                                  run(compile_c(tmp_path, "encoder", ENCODER)).split())

    def nlattr(t, data):
        n = 4 + len(data)
        return struct.pack("=HH", n, t) + data + b"\0" * ((4 - n % 4) % 4)

    def dump(msg_type, opts, xstats):
        body = struct.pack("=BBHiIII", 0, 0, 0, 3, 0xF1F00010, 0xFFFFFFFF, 0)
        body += nlattr(TCA_KIND, b"psp\0") + nlattr(TCA_OPTIONS, opts) + nlattr(TCA_XSTATS, xstats)
        body += nlattr(TCA_STATS2, nlattr(TCA_STATS_APP, xstats))
        m = tcmsg(struct.pack("=IHHII", 16 + len(body), msg_type, 0, 1, 0) + body)
        m.decode()
        return m

    q = dump(RTM_NEWQDISC, qopt, qxs)
    o = q.get_attr("TCA_OPTIONS")
    assert (o.get_attr("TCA_PSP_LINK_RATE"), o.get_attr("TCA_PSP_DEFCLS"),
            o.get_attr("TCA_PSP_OVERHEAD"), o.get_attr("TCA_PSP_LIMIT"),
            o.get_attr("TCA_PSP_CATCHUP")) == (125_000_000, 2, 24, 777, 30_000_000)
    xs = q.get_attr("TCA_XSTATS")
    want = dict(link_rate=125_000_000, rate_sum=3, paced_pkts=4, borrowed_pkts=5, unpaced_pkts=6,
                late_ns_total=7, late_ns_max=8, clamps=9, timer_fires=10, timer_late_ns_max=11,
                gso_split=12, longest_run=15, classes=13, active=14)
    assert {k: xs[k] for k in want} == want
    assert {k: q.get_attr("TCA_STATS2").get_attr("TCA_STATS_APP")[k] for k in want} == want
    assert psp.parse_qdisc_xstats(qxs) == want

    c = dump(RTM_NEWTCLASS, copt, cxs)
    o = c.get_attr("TCA_OPTIONS")
    assert (o.get_attr("TCA_PSP_CLASS_RATE"), o.get_attr("TCA_PSP_CLASS_CEIL"),
            o.get_attr("TCA_PSP_CLASS_LIMIT")) == (1_250_000, 2_500_000, 777)
    want = dict(rate=1_250_000, ceil=2_500_000, eff_rate=21, rate_est=22, borrowed_bytes=23,
                borrowed_pkts=24, clamps=25, late_ns_max=26, clock_ns=-27, limit=777,
                flags=psp.PSP_CLASS_F_DEFAULT | psp.PSP_CLASS_F_ACTIVE, group_sum=28,
                group_held=29, members=30, pad=0)
    xs = c.get_attr("TCA_XSTATS")
    assert {k: xs[k] for k in want} == want
    assert psp.parse_class_xstats(cxs) == want
    from flowpacer.kernel.tc.nl import parse_attrs
    opts = parse_attrs(copt)
    assert psp.parse_class_rates(opts) == (1_250_000, 2_500_000)
    assert psp.parse_class_limit(opts) == 777
    assert not psp.is_group(opts)
    # a group as the module dumps it: its rate (the cap) and the flag, no ceil, no limit
    g = dump(RTM_NEWTCLASS, gopt, cxs).get_attr("TCA_OPTIONS")
    assert g.get_attr("TCA_PSP_CLASS_RATE") == 2_500_000
    assert g.get_attr("TCA_PSP_CLASS_GROUP") is not None
    gopts = parse_attrs(gopt)
    assert psp.is_group(gopts) and psp.parse_class_rates(gopts) == (2_500_000, 2_500_000)
    assert psp.parse_qdisc_options(parse_attrs(qopt)) == dict(
        link_rate_bps=125_000_000, default_minor=2, overhead_bytes=24, limit=777,
        catchup_ns=30_000_000)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, message", [
    (lambda: psp.get_parameters({"link_rate": "8mbit"}), "link_rate must be an integer"),
    (lambda: psp.get_parameters({"link_rate": 0}), "link_rate 0 is outside"),
    (lambda: psp.get_parameters({"link_rate": (1 << 40) + 1}), "outside"),
    (lambda: psp.get_parameters({"default": "f1f0:0"}), "default class minor 0"),
    (lambda: psp.get_parameters({"default": "f1f0:zz"}), "is not a class id"),
    (lambda: psp.get_parameters({"overhead": 2000}), "overhead 2000"),
    (lambda: psp.get_parameters({"catchup": 10 ** 9 + 1}), "catchup 1000000001 is outside"),
    (lambda: psp.qdisc_options(None, catchup_ns=-1), "catchup -1 is outside"),
    (lambda: psp.get_class_parameters({"rate": 10, "ceil": 5}), "ceil 5 is below rate 10"),
    (lambda: psp.get_class_parameters({"rate": True}), "rate must be an integer"),
    (lambda: psp.class_options(0), "rate 0 is outside"),
    (lambda: psp.class_options(10, 5), "ceil 5 is below rate 10"),
    (lambda: psp.class_options(10, limit=0), "limit 0 is outside"),
    (lambda: psp.class_options(10, estimator=(9, 3)), "estimator interval 9"),
])
def test_bad_values_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_register_is_idempotent_and_plugs_in():
    from pyroute2.netlink.rtnl.tcmsg import plugins
    psp.register()
    psp.register()
    assert plugins["psp"] is psp
    from flowpacer.kernel import tc
    tc.register()
    assert plugins["psp"] is psp


# --------------------------------------------- pyroute2 request against a kernel


@pytest.fixture
def netns(root):
    name = f"fppsp{os.getpid()}{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)


def test_pyroute2_request_reaches_the_kernel(netns):
    """The plugin's hooks run inside pyroute2's real request pipeline and the kernel parses the
    message as far as the qdisc kind: this kernel has no psp qdisc and says so."""
    from pyroute2 import NetNS
    from pyroute2.netlink.exceptions import NetlinkError
    psp.register()
    with NetNS(netns) as ns:
        idx = ns.link_lookup(ifname="lo")[0]
        with pytest.raises(NetlinkError) as e:
            ns.tc("add", kind="psp", index=idx, handle=0xF1F00000, link_rate=125_000_000,
                  default=2, limit=100)
        assert e.value.code in (errno.ENOENT, errno.EINVAL), e.value
        # the request was well formed: a kind this kernel has is accepted the same way
        ns.tc("add", kind="htb", index=idx, handle=0xF1F00000, default=2)
        ns.tc("del", kind="htb", index=idx, handle=0xF1F00000)
        # and a psp class request is refused because there is no psp qdisc to hold it
        with pytest.raises(NetlinkError):
            ns.tc("add-class", kind="psp", index=idx, handle=0xF1F00010, parent=0xF1F00000,
                  rate=1_250_000, ceil=2_500_000)
