"""Property tests of the rules loader: round trips, and no input escapes as anything
but a RulesError whose every problem is a well-formed FILE:LINE:COL line."""
from __future__ import annotations

import ipaddress
import os
import re

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flowpacer.policy import rules
from flowpacer import units
from flowpacer.errors import RulesError
from flowpacer.model import BackendKind, Direction, Match, PortSet, Protocol, Rule, RuleSet

# FP_EXAMPLES=5000 for a deeper run by hand
SETTINGS = settings(max_examples=int(os.environ.get("FP_EXAMPLES", "200")), deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PATH = "gen.yaml"
PROBLEM_RE = re.compile(r"gen\.yaml:(\d+):(\d+): \S.*")

# --------------------------------------------------------------- strategies

NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
text_chars = st.characters(blacklist_categories=("Cc", "Cs"))

names = st.text(NAME_CHARS, min_size=1, max_size=20)
ifnames = st.one_of(
    st.just(""),
    st.text(NAME_CHARS, min_size=1, max_size=15).filter(lambda s: s not in (".", "..")))
comms = st.text(text_chars, min_size=1, max_size=15).filter(lambda s: len(s.encode()) <= 15)
exes = st.text(text_chars, max_size=30).map(lambda s: "/" + s)
uids = st.integers(0, 2**32 - 2)
port_ranges = st.tuples(st.integers(1, 65535), st.integers(1, 65535)).map(
    lambda t: (min(t), max(t)))
port_sets = st.lists(port_ranges, max_size=3).map(lambda rs: PortSet(tuple(rs)))


@st.composite
def networks(draw):
    v6 = draw(st.booleans())
    addr = draw(st.ip_addresses(v=6 if v6 else 4))
    prefix = draw(st.integers(0, 128 if v6 else 32))
    return ipaddress.ip_network((addr, prefix), strict=False)


def tuples_of(s, max_size=3):
    return st.lists(s, max_size=max_size).map(tuple)


def matches(n=3):
    return st.builds(
        Match,
        process=tuples_of(comms, n),
        exe=tuples_of(exes, min(n, 2)),
        user=tuples_of(uids, min(n, 2)),
        direction=st.sampled_from(list(Direction)),
        local_port=port_sets,
        remote_port=port_sets,
        remote=tuples_of(networks(), n),
        protocol=st.sampled_from(list(Protocol)),
    ).filter(lambda m: m != Match(direction=m.direction, protocol=m.protocol))


MATCHES = {n: matches(n) for n in (1, 3)}    # built once: building strategies is slow


@st.composite
def rulesets(draw, max_rules=5, min_rules=0, list_size=3):
    link = draw(st.one_of(st.none(), st.integers(1, units.MAX_RATE_BPS)))
    top = link if link is not None else units.MAX_RATE_BPS
    rule_names = draw(st.lists(names, min_size=min_rules, max_size=max_rules, unique=True))
    rs = []
    for n in rule_names:
        rate = draw(st.integers(1, min(top, 10**10)) if draw(st.booleans())
                    else st.integers(1, top))
        ceil = draw(st.integers(rate, top)) if draw(st.booleans()) else None
        # aggregates (issue 15): rate <= client_rate <= total_rate, ceil within them
        lo = ceil if ceil is not None else rate
        client = draw(st.integers(lo, top)) if draw(st.booleans()) else None
        total = draw(st.integers(client or lo, top)) if draw(st.booleans()) else None
        prefix = (draw(st.tuples(st.integers(0, 32), st.integers(0, 128)))
                  if client is not None and draw(st.booleans()) else (32, 64))
        # idle_timeout (issue 17): whole seconds, milliseconds or odd nanoseconds, 1 s..24 h
        idle = draw(st.one_of(st.just(30 * 10**9), st.integers(1, 86400).map(lambda s: s * 10**9),
                              st.integers(10**9, 86400 * 10**9)))
        # uploads (issue 17): receive_rate (and receive_ceil); or receive-only (no rate, and so
        # nothing of the send side)
        rrate = draw(st.integers(1, top)) if draw(st.booleans()) else None
        rceil = draw(st.integers(rrate, top)) if rrate is not None and draw(st.booleans()) \
            else None
        if rrate is not None and draw(st.integers(0, 3)) == 0:
            rate = ceil = client = total = None
            prefix = (32, 64)
        rs.append(Rule(name=n, match=draw(MATCHES[list_size]), rate_bps=rate, ceil_bps=ceil,
                       client_rate_bps=client, total_rate_bps=total, client_prefix=prefix,
                       idle_timeout_ns=idle, receive_rate_bps=rrate, receive_ceil_bps=rceil))
    return RuleSet(interface=draw(ifnames), backend=draw(st.sampled_from(list(BackendKind))),
                   link_rate_bps=link, rules=tuple(rs),
                   ready_classes=draw(st.sampled_from((0, 1, 2000, 16384))))


def check_problems(e: RulesError) -> None:
    assert e.problems
    for p in e.problems:
        s = str(p)
        assert "\n" not in s and "\r" not in s, s
        m = PROBLEM_RE.fullmatch(s)
        assert m, s
        assert int(m[1]) >= 1 and int(m[2]) >= 1, s


def load_or_problems(data):
    """Never anything but a RuleSet or a well-formed RulesError."""
    try:
        return rules.loads(data, PATH)
    except RulesError as e:
        check_problems(e)
        return e


def must_fail(data) -> RulesError:
    r = load_or_problems(data)
    assert isinstance(r, RulesError), (data, r)
    return r


# -------------------------------------------------------------- round trip

@SETTINGS
@given(rulesets())
def test_dump_load_round_trip(rs):
    text = rules.dump(rs)
    back = rules.loads(text, PATH)
    assert rules.without_provenance(back) == rs
    assert back.path == PATH
    assert rules.dump(back) == text
    assert len(rules.describe(back)) == \
        4 + bool(rs.ready_classes) + len(rs.rules) + len(back.warnings)


@SETTINGS
@given(st.integers(1, units.MAX_RATE_BPS))
def test_rate_format_round_trip(bps):
    assert units.parse_rate(units.format_rate(bps)) == bps


@SETTINGS
@given(st.sampled_from(sorted(u for u in units.UNITS if u)),
       st.integers(1, 10**6), st.integers(0, 999))
def test_rate_units_scale(unit, whole, frac):
    text = f"{whole}.{frac:03d}{unit.upper() if frac % 2 else unit}"
    bits = (whole * 1000 + frac) * units.UNITS[unit]        # in thousandths
    expect = max(1, (bits + 4000) // 8000)                  # /1000 /8, halves up
    assert units.parse_rate(text) == expect


# ---------------------------------------------------------- invalid input

def base_doc(rs: RuleSet) -> dict:
    return yaml.safe_load(rules.dump(rs))


small_rulesets = rulesets(max_rules=2, list_size=1)
nonempty_rulesets = rulesets(max_rules=2, min_rules=1, list_size=1)

bad_rates = st.sampled_from(["8mbits", "fast", "-1mbit", "0", "0bit", "8 mbit", "1e99",
                             "18446744073709551616bps", "101%", "", "0x10", "nan", "inf",
                             True, False, None, [1], {"a": 1}, 0, -5, 1.5e300])
wrong_type_values = st.sampled_from([None, [], {}, [[1]], {"a": [1]}, True, 1.5, -1])
unknown_keys = st.text(text_chars, min_size=1, max_size=12)


@st.composite
def invalid_docs(draw):
    """A dumped valid RuleSet with one change that makes it certainly invalid."""
    rs = draw(nonempty_rulesets)
    doc = base_doc(rs)
    i = draw(st.integers(0, len(doc["rules"]) - 1))
    r = doc["rules"][i]
    kind = draw(st.sampled_from(["rate", "ceil", "link_rate", "unknown_top", "unknown_rule",
                                 "unknown_match", "wrong_name", "wrong_match", "wrong_rules",
                                 "backend", "interface", "dup_name", "long_comm", "host_bits",
                                 "port", "empty_match", "ceil_below", "missing"]))
    if kind == "rate":
        r["rate"] = draw(bad_rates)
    elif kind == "ceil":
        r["ceil"] = draw(bad_rates.filter(lambda v: v != "101%"))
    elif kind == "link_rate":
        doc["link_rate"] = draw(st.sampled_from(["50%", "1gbits", "0", "", None, [1], True]))
    elif kind == "unknown_top":
        k = draw(unknown_keys.filter(lambda k: k not in ("interface", "backend", "link_rate",
                                                         "rules")))
        doc[k] = draw(st.integers())
    elif kind == "unknown_rule":
        k = draw(unknown_keys.filter(lambda k: k not in ("name", "match", "rate", "ceil")))
        r[k] = "x"
    elif kind == "unknown_match":
        k = draw(unknown_keys.filter(lambda k: k not in {f.name for f in rules.MATCH_FIELDS}))
        r["match"][k] = 1
    elif kind == "wrong_name":
        # (true, 1.5, -1 are fine names: scalars are read as written)
        r["name"] = draw(st.sampled_from([None, [], {}, [[1]], {"a": [1]}, "a b", "x" * 65,
                                          "", "é", "a/b"]))
    elif kind == "wrong_match":
        r["match"] = draw(st.sampled_from([None, [], "musicd", 5, {}, {"direction": "any"}]))
    elif kind == "wrong_rules":
        doc["rules"] = draw(st.sampled_from([None, {}, "x", 5, [1], [[]], [None]]))
    elif kind == "backend":
        doc["backend"] = draw(st.one_of(wrong_type_values,
                                        st.sampled_from(["HTB", "cake", "htbb", ""])))
    elif kind == "interface":
        doc["interface"] = draw(st.sampled_from(["", ".", "..", "a/b", "a b", "x" * 16, "a:b",
                                                 None, [], {}]))
    elif kind == "dup_name":
        doc["rules"].append(dict(r))
    elif kind == "long_comm":
        r["match"]["process"] = draw(st.text(NAME_CHARS, min_size=16, max_size=40))
    elif kind == "host_bits":
        r["match"]["remote"] = draw(st.sampled_from(["192.0.2.1/24", "2001:db8::1/32",
                                                     "10.0.0.0/33", "example.com", "10"]))
    elif kind == "port":
        r["match"][draw(st.sampled_from(["local_port", "remote_port"]))] = draw(
            st.sampled_from([0, 65536, "9-8", "80:90", "http", -1, [], [0], True, 1.5]))
    elif kind == "empty_match":
        r["match"] = {}
    elif kind == "ceil_below":
        # a receive-only rule has no rate: give it one with a ceil below it
        rate = units.parse_rate(r["rate"]) if "rate" in r else 1
        if rate == 1:
            r["rate"] = "16bit"
            r["ceil"] = "8bit"
        else:
            r["ceil"] = units.format_rate(rate - 1)
    elif kind == "missing":
        # what a rule cannot lack: its name, its match, and the only rate it has (send or
        # receive; without both it is refused)
        only = [k for k in ("rate", "receive_rate") if k in r]
        del r[draw(st.sampled_from(["name", "match"] + (only if len(only) == 1 else [])))]
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=draw(st.booleans()),
                          default_flow_style=draw(st.sampled_from([False, None, True])))


@SETTINGS
@given(invalid_docs())
def test_invalid_documents_raise_rules_error(text):
    must_fail(text)


@SETTINGS
@given(small_rulesets, st.sampled_from([
    "\n'unterminated",            # a quoted scalar that never ends
    "\nrules: a: b",              # a mapping value where none may be
    "\n---\nx: 1\n",              # a second document
    "\n[",                         # a flow collection that never ends
    "\n  \t- x: [",
    "\n*alias",
]), st.booleans())
def test_broken_yaml_raises_rules_error(rs, junk, as_bytes):
    text = rules.dump(rs) + junk
    must_fail(text.encode() if as_bytes else text)


@SETTINGS
@given(small_rulesets, st.data())
def test_corrupted_text_never_escapes(rs, data):
    """Random edits anywhere (may or may not stay valid): never another exception."""
    text = rules.dump(rs)
    pos = data.draw(st.integers(0, len(text)))
    ins = data.draw(st.text(st.sampled_from("[]{}:,-&*!|>'\"%@`#?\t\n \\\x00\x85é"),
                            max_size=4))
    cut = data.draw(st.integers(0, 3))
    load_or_problems(text[:pos] + ins + text[pos + cut:])


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_never_escape(data):
    r = load_or_problems(data)
    if isinstance(r, RuleSet):
        assert rules.without_provenance(rules.loads(rules.dump(r))) == \
            rules.without_provenance(r)


@SETTINGS
@given(st.text(max_size=200))
def test_random_text_never_escapes(text):
    load_or_problems(text)


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.text(max_size=20))
yaml_values = st.recursive(
    yaml_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=10), children, max_size=4)),
    max_leaves=10)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["interface", "backend", "link_rate", "rules", "x"]),
                       yaml_values, max_size=5),
       st.lists(st.dictionaries(st.sampled_from(["name", "match", "rate", "ceil", "y"]),
                                yaml_values, max_size=5), max_size=3))
def test_nested_garbage_never_escapes(top, rule_list):
    doc = dict(top)
    if rule_list:
        doc["rules"] = rule_list
    text = yaml.safe_dump(doc, allow_unicode=True)
    r = load_or_problems(text)
    assume(isinstance(r, (RuleSet, RulesError)))
