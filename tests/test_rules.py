"""flowpacer.policy.rules: every field, every error with its exact FILE:LINE:COL message."""
from __future__ import annotations

import ipaddress
import os
import pwd
import re
import textwrap
from pathlib import Path

import pytest

from flowpacer.policy import rules
from flowpacer.errors import RulesError
from flowpacer.model import BackendKind, Direction, Match, PortSet, Protocol, Rule, RuleSet

ROOT = Path(__file__).resolve().parent.parent
F = "r.yaml"


def ok(text: str) -> RuleSet:
    return rules.loads(textwrap.dedent(text), F)


def errs(text) -> list[str]:
    if isinstance(text, str):
        text = textwrap.dedent(text)
    with pytest.raises(RulesError) as ei:
        rules.loads(text, F)
    out = [str(p) for p in ei.value.problems]
    assert str(ei.value) == "\n".join(out)
    for line in out:
        assert "\n" not in line
    return out


def err(text) -> str:
    (one,) = errs(text)
    return one


def rule(match: str, extra: str = "", rate: str = "8mbit", head: str = "") -> str:
    """A one-rule file: the rule's match is on line 3 (line 4 with a head line)."""
    return f"{head}rules:\n  - name: r\n    match: {match}\n    rate: {rate}\n{extra}"


def match_of(match: str) -> Match:
    return rules.loads(rule(match), F).rules[0].match


# ----------------------------------------------------------- good files

def test_example_file():
    rs = rules.load(str(ROOT / "rules/example.yaml"))
    assert rs.path == str(ROOT / "rules/example.yaml")
    assert rs.interface == "eth0"
    assert rs.backend is BackendKind.AUTO
    assert rs.link_rate_bps == 125_000_000
    s, m, d = rs.rules
    assert (d.rate_bps, d.ceil_bps, d.client_rate_bps, d.total_rate_bps, d.client_prefix) == (
        1_000_000, 2_000_000, 2_500_000, 75_000_000, (32, 64))
    assert not rs.warnings
    assert s == Rule("streaming", Match(process=("musicd",), direction=Direction.INBOUND,
                                        local_port=PortSet(((8443, 8443),))),
                     rate_bps=1_000_000, ceil_bps=None, line=s.line)
    assert m.name == "mirror-sync"
    assert m.match.process == ("rsync",)
    assert m.match.remote == (ipaddress.ip_network("192.0.2.0/24"),
                              ipaddress.ip_network("2001:db8::/32"))
    assert (m.rate_bps, m.ceil_bps) == (25_000_000, 75_000_000)
    text = (ROOT / "rules/example.yaml").read_text().splitlines()
    assert text[s.line - 1].strip() == "- name: streaming"
    assert text[m.line - 1].strip() == "- name: mirror-sync"


def test_demo_file():
    rs = rules.load(str(ROOT / "rules/demo.yaml"))
    assert (rs.interface, rs.backend, rs.link_rate_bps) == ("fp-demo0", BackendKind.HTB,
                                                            125_000_000)
    got = [(r.match.process, r.match.direction, r.match.local_port.ranges, r.rate_bps,
            r.ceil_bps) for r in rs.rules]
    inb = Direction.INBOUND
    assert got == [
        (("fp-demo-srv",), inb, ((8081, 8081),), 1_250_000, None),
        (("fp-demo-srv",), inb, ((8082, 8082),), 3_125_000, None),
        (("fp-demo-srv",), inb, ((8083, 8083),), 6_250_000, 10_000_000),
    ]


def test_minimal_and_defaults():
    rs = ok("{}")
    assert rs == RuleSet(interface="", backend=BackendKind.AUTO, link_rate_bps=None, rules=(),
                         path=F)
    rs = ok("rules: []")
    assert rs.rules == ()
    assert rules.loads("interface: eth0\n").path == "<string>"


def test_rule_order_and_lines():
    rs = ok("""\
        rules:
          - name: a
            match: {process: x}
            rate: 1mbit
          - {name: b, match: {process: y}, rate: 2mbit}
          - name: c
            match:
              process: z
            rate: 3mbit
        """)
    assert [(r.name, r.line) for r in rs.rules] == [("a", 2), ("b", 5), ("c", 6)]
    assert rs.rule("b").rate_bps == 250_000
    assert rs.rule("nope") is None


def test_backends():
    for b in BackendKind:
        assert ok(f"backend: {b.value}").backend is b


def test_interface_names():
    for name in ("eth0", "fp-demo0", "a" * 15, "wlp0s20f3", "br.10", "0"):
        assert ok(f"interface: '{name}'").interface == name


def test_link_rate_and_percent():
    rs = rules.loads(rule("{process: x}", rate="25%", head="link_rate: 1gbit\n"), F)
    assert rs.link_rate_bps == 125_000_000
    assert rs.rules[0].rate_bps == 31_250_000


def test_rate_forms():
    for text, bps in (("8mbit", 1_000_000), ("8000", 1000), ("1.5", 1), ("1MBps", 1_000_000),
                      ("'1e6'", 125_000), ("1.0e+6", 125_000), ("12bit", 2)):
        assert rules.loads(rule("{process: x}", rate=text), F).rules[0].rate_bps == bps, text


def test_ceil_equal_to_rate_and_link():
    rs = rules.loads(rule("{process: x}", "    ceil: 1gbit\n", rate="1gbit",
                          head="link_rate: 1gbit\n"), F)
    assert rs.rules[0].ceil_bps == rs.rules[0].rate_bps == rs.link_rate_bps


def test_match_fields():
    m = match_of("{process: [musicd, 'py*'], exe: /usr/bin/rsync, user: [root, 0, '1234'],"
                 " direction: outbound, local_port: [80, 8000-8100, '9000 - 9001'],"
                 " remote_port: 443, remote: [10.0.0.1, '10.1.0.0/16', '::1', '2001:db8::/32']}")
    assert m.process == ("musicd", "py*")
    assert m.exe == ("/usr/bin/rsync",)
    assert m.user == (0, 0, 1234)
    assert m.direction is Direction.OUTBOUND
    assert m.local_port == PortSet(((80, 80), (8000, 8100), (9000, 9001)))
    assert m.remote_port == PortSet(((443, 443),))
    assert m.remote == tuple(ipaddress.ip_network(n) for n in
                             ("10.0.0.1/32", "10.1.0.0/16", "::1/128", "2001:db8::/32"))


def test_scalars_are_read_as_written():
    # YAML 1.1 would make these a bool, an int, a float: they are names here
    assert match_of("{process: yes}").process == ("yes",)
    assert match_of("{process: 0x10}").process == ("0x10",)
    assert match_of("{process: 1.50}").process == ("1.50",)
    assert ok("rules: [{name: 007, match: {process: x}, rate: 1mbit}]").rules[0].name == "007"
    assert match_of("{process: '123456789012345'}").process == ("123456789012345",)


def test_user_names_resolve():
    nobody = pwd.getpwnam("nobody").pw_uid
    assert match_of("{user: nobody}").user == (nobody,)
    assert match_of("{user: 4294967294}").user == (4294967294,)


def test_process_globs_at_the_limit():
    assert match_of("{process: 'abcdefghijklmno*'}").process == ("abcdefghijklmno*",)
    assert match_of("{process: '[ab]bcdefghijklmn?'}").process  # 15 characters
    assert match_of("{process: '[unclosed'}").process == ("[unclosed",)


# ------------------------------------------------------- top-level errors

@pytest.mark.parametrize("value,msg", [
    ("''", "empty interface name"),
    ("abcdefghijklmnop", "'abcdefghijklmnop' is too long: a Linux interface name is at most "
                         "15 bytes"),
    ("'.'", "'.' is not a valid interface name"),
    ("'..'", "'..' is not a valid interface name"),
    ("eth0/1", "'eth0/1': an interface name cannot contain '/' (no '/', ':', whitespace)"),
    ("'eth 0'", "'eth 0': an interface name cannot contain ' ' (no '/', ':', whitespace)"),
    ("'eth0:1'", "'eth0:1': an interface name cannot contain ':' (no '/', ':', whitespace)"),
    ("[eth0]", "expected an interface name, found a list"),
    ("~", "no value (expected an interface name; remove the key to use the default)"),
])
def test_interface_errors(value, msg):
    assert err(f"interface: {value}\n") == f"r.yaml:1:12: interface: {msg}"


def test_empty_value_points_after_the_key():
    assert err("interface:\n") == "r.yaml:1:11: interface: no value (expected an interface " \
                                   "name; remove the key to use the default)"


def test_backend_error_with_hint():
    assert err("backend: htbb\n") == \
        "r.yaml:1:10: backend: 'htbb' is not a backend: use auto, psp or htb; did you mean 'htb'?"
    assert err("backend: cake\n") == \
        "r.yaml:1:10: backend: 'cake' is not a backend: use auto, psp or htb"


def test_link_rate_errors():
    assert err("link_rate: 50%\n") == \
        "r.yaml:1:12: link_rate: '50%': link_rate cannot be a percentage (give e.g. '1gbit')"
    assert err("link_rate: 1gbitt\n") == \
        "r.yaml:1:12: link_rate: unknown rate unit 'gbitt'; did you mean 'gbit'?"
    assert err("link_rate: 0\n") == "r.yaml:1:12: link_rate: '0': a rate must be > 0"
    assert err("link_rate: true\n") == \
        "r.yaml:1:12: link_rate: 'true' is not a rate (expected e.g. '8mbit')"


def test_unknown_top_keys():
    assert err("intreface: eth0\n") == "r.yaml:1:1: intreface: unknown key; did you mean 'interface'?"
    assert err("speed: 1\n") == \
        "r.yaml:1:1: speed: unknown key; valid keys: interface, backend, link_rate, interfaces, ready_classes, rules"
    assert err("'a b': 1\n") == \
        "r.yaml:1:1: 'a b': unknown key; valid keys: interface, backend, link_rate, interfaces, ready_classes, rules"


def test_duplicate_keys():
    assert err("interface: a\nbackend: htb\ninterface: b\n") == \
        "r.yaml:3:1: interface: duplicate key (first at line 1)"
    assert errs(rule("{process: x, process: y}")) == [
        "r.yaml:3:25: rule 'r': match.process: duplicate key (first at line 3)"]
    assert errs("rules:\n  - name: r\n    match: {process: x}\n    rate: 1mbit\n    rate: 2mbit\n") \
        == ["r.yaml:5:5: rule 'r': rate: duplicate key (first at line 4)"]


def test_document_shape_errors():
    assert err("") == "r.yaml:1:1: the file is empty: expected a mapping with interface, " \
                      "backend, link_rate, interfaces, ready_classes, rules"
    assert err("# only a comment\n") == "r.yaml:1:1: the file is empty: expected a mapping " \
                                        "with interface, backend, link_rate, interfaces, ready_classes, rules"
    assert err("- a\n") == "r.yaml:1:1: the rules file must be a mapping with interface, " \
                           "backend, link_rate, interfaces, ready_classes, rules, found a list"
    assert err("rules: {}\n") == "r.yaml:1:8: rules: expected a list of rules, found a mapping"
    assert err("rules:\n") == "r.yaml:1:7: rules: expected a list of rules, found nothing"
    assert err("rules: [42]\n") == \
        "r.yaml:1:9: rule #1: expected a mapping with name, match, rate; found '42'"
    assert err("? [a]\n: 1\n") == "r.yaml:1:3: keys must be plain names, found a list"


# ---------------------------------------------------------- rule errors

def test_rule_name_errors():
    assert err("rules: [{match: {process: x}, rate: 1mbit}]") == \
        "r.yaml:1:9: rule #1: name: missing (required: unique name of the rule: letters, " \
        "digits, '_', '.', '-')"
    assert err("rules: [{name: 'a b', match: {process: x}, rate: 1mbit}]") == \
        "r.yaml:1:16: rule #1: name: 'a b' is not a valid rule name (letters, digits, '_', " \
        "'.', '-' only)"
    long = "n" * 65
    assert err(f"rules: [{{name: {long}, match: {{process: x}}, rate: 1mbit}}]") == \
        "r.yaml:1:16: rule #1: name: rule name too long (65 characters, at most 64)"
    assert errs("""\
        rules:
          - {name: a, match: {process: x}, rate: 1mbit}
          - {name: b, match: {process: x}, rate: 1mbit}
          - {name: a, match: {process: y}, rate: 1mbit}
        """) == ["r.yaml:4:12: rule 'a': name: duplicate rule name (first defined at line 2)"]


def test_rule_missing_fields_and_unknown_keys():
    assert errs("rules: [{name: a}]") == [
        "r.yaml:1:9: rule 'a': match: missing: a rule with no match fields would shape every "
        "flow of every process",
        "r.yaml:1:9: rule 'a': rate: missing: give rate (what each flow is sent), receive_rate "
        "(what each flow may upload), or both",
    ]
    assert err("rules: [{name: a, match: {process: x}, rate: 1mbit, ciel: 2mbit}]") == \
        "r.yaml:1:53: rule 'a': ciel: unknown key; did you mean 'ceil'?"


def test_match_errors():
    empty = ("no match fields: the rule would shape every flow of every process; give "
             "process, exe, user, ports or remote")
    assert err(rule("{}")) == f"r.yaml:3:12: rule 'r': match: {empty}"
    assert err(rule("{direction: any}")) == f"r.yaml:3:12: rule 'r': match: {empty}"
    assert err(rule("")) == f"r.yaml:3:11: rule 'r': match: {empty}"
    assert err(rule("musicd")) == (
        "r.yaml:3:12: rule 'r': match: expected a mapping of match fields (process, exe, "
        "user, direction, local_port, remote_port, remote, protocol), found 'musicd'")
    assert err(rule("{procss: x}")) == \
        "r.yaml:3:13: rule 'r': match.procss: unknown key; did you mean 'process'?"
    assert err(rule("{port: 80}")) == (
        "r.yaml:3:13: rule 'r': match.port: unknown key; valid keys: process, exe, user, "
        "direction, local_port, remote_port, remote, protocol")


@pytest.mark.parametrize("match,col,msg", [
    ("{process: a-very-long-process-name}", 22,
     "match.process: 'a-very-long-process-name' is 24 characters but the kernel's comm is at "
     "most 15: it can never match; use 'a-very-long-pro' or match exe"),
    ("{process: 'a??????????????????*'}", 22,
     "match.process: 'a??????????????????*' needs at least 19 characters but a comm is at most "
     "15: it can never match (match exe for full names)"),
    ("{process: ''}", 22, "match.process: empty process name"),
    ("{process: []}", 22, "match.process: empty list (expected a process name (comm) or glob, "
                          "or a list of them; remove the key to match any)"),
    ("{process: [[a]]}", 23, "match.process: expected a process name (comm) or glob, "
                             "found a list"),
    ("{process: {a: 1}}", 22, "match.process: expected a process name (comm) or glob, "
                              "found a mapping"),
    ("{process: \"a\\tb\"}", 22, "match.process: 'a\\tb': control characters are not allowed"),
    ("{exe: usr/bin/x}", 18, "match.exe: 'usr/bin/x' is not an absolute path (exe must start "
                             "with '/', e.g. /usr/bin/rsync or /usr/bin/python3*)"),
    ("{user: no-such-user-fp}", 19, "match.user: unknown user 'no-such-user-fp'"),
    ("{user: 4294967295}", 19, "match.user: uid '4294967295' out of range (0..4294967294)"),
    ("{user: -1}", 19, "match.user: uid '-1' out of range (0..4294967294)"),
    ("{user: rooot}", 19, "match.user: unknown user 'rooot'; did you mean 'root'?"),
    ("{process: x, direction: in}", 36, "match.direction: 'in' is not a direction: use inbound "
                                        "(accepted), outbound (connected) or any"),
    ("{process: x, direction: Inbound}", 36, "match.direction: 'Inbound' is not a direction: "
     "use inbound (accepted), outbound (connected) or any; did you mean 'inbound'?"),
    ("{local_port: 0}", 25, "match.local_port: port 0 out of range (1..65535)"),
    ("{local_port: 65536}", 25, "match.local_port: port 65536 out of range (1..65535)"),
    ("{local_port: 9000-8000}", 25, "match.local_port: '9000-8000': range start 9000 is above "
                                    "its end 8000"),
    ("{remote_port: 80:90}", 26, "match.remote_port: '80:90' is not a port or a port range "
                                 "(write a range as 8000-8100)"),
    ("{remote_port: http}", 26, "match.remote_port: 'http' is not a port or a port range"),
    ("{remote_port: true}", 26, "match.remote_port: 'true' is not a port or a port range"),
    ("{remote: 192.0.2.1/24}", 21, "match.remote: '192.0.2.1/24' has host bits set; did you "
                                   "mean '192.0.2.0/24'?"),
    ("{remote: '2001:db8::1/32'}", 21, "match.remote: '2001:db8::1/32' has host bits set; did "
                                       "you mean '2001:db8::/32'?"),
    ("{remote: 10}", 21, "match.remote: '10' is not an IPv4/IPv6 address or CIDR network"),
    ("{remote: example.com}", 21, "match.remote: 'example.com' is not an IPv4/IPv6 address or "
                                  "CIDR network"),
    ("{remote: 'fe80::1%eth0'}", 21, "match.remote: 'fe80::1%eth0' is not an IPv4/IPv6 address "
                                     "or CIDR network"),
    ("{remote: 10.0.0.0/33}", 21, "match.remote: '10.0.0.0/33' is not an IPv4/IPv6 address or "
                                  "CIDR network ('10.0.0.0/33' does not appear to be an IPv4 "
                                  "or IPv6 network)"),
])
def test_match_field_errors(match, col, msg):
    assert err(rule(match)) == f"r.yaml:3:{col}: rule 'r': {msg}"


def test_every_bad_list_item_is_reported():
    assert errs(rule("{process: [ok, '', a-very-long-process-name], local_port: [1, 0, 70000]}")) == [
        "r.yaml:3:27: rule 'r': match.process: empty process name",
        "r.yaml:3:31: rule 'r': match.process: 'a-very-long-process-name' is 24 characters but "
        "the kernel's comm is at most 15: it can never match; use 'a-very-long-pro' or match exe",
        "r.yaml:3:74: rule 'r': match.local_port: port 0 out of range (1..65535)",
        "r.yaml:3:77: rule 'r': match.local_port: port 70000 out of range (1..65535)",
    ]


@pytest.mark.parametrize("rate,msg", [
    ("8mbits", "unknown rate unit 'mbits'; did you mean 'mbit'?"),
    ("0", "'0': a rate must be > 0"),
    ("-5mbit", "'-5mbit': a rate must be > 0"),
    ("'8 mbit'", "'8 mbit': no space between number and unit (write '8mbit', as tc wants it)"),
    ("50%", "'50%': a percentage needs link_rate in the rules file (it is a percentage of "
            "link_rate)"),
    ("99999999999tbit", "'99999999999tbit': rate too large (above 2^64-1 bytes/s)"),
    (".inf", "not a rate: '.inf' (expected a number with a tc unit, e.g. '8mbit')"),
    ("[8mbit]", "expected a rate like '8mbit', found a list"),
    ("~", "no value (expected a rate like '8mbit'; remove the key to use the default)"),
])
def test_rate_errors(rate, msg):
    assert err(rule("{process: x}", rate=rate)) == f"r.yaml:4:11: rule 'r': rate: {msg}"


def test_cross_field_checks():
    assert err(rule("{process: x}", "    ceil: 4mbit\n")) == \
        "r.yaml:5:11: rule 'r': ceil: 4 Mbit/s is below rate 8 Mbit/s (ceil must be >= rate)"
    assert errs(rule("{process: x}", "    ceil: 2gbit\n", rate="1500mbit",
                     head="link_rate: 1gbit\n")) == [
        "r.yaml:5:11: rule 'r': rate: 1.5 Gbit/s is above link_rate 1 Gbit/s: a flow can never "
        "get it",
        "r.yaml:6:11: rule 'r': ceil: 2 Gbit/s is above link_rate 1 Gbit/s: a flow can never "
        "get it",
    ]
    assert errs(rule("{process: x}", rate="50%", head="link_rate: 1gbitt\n")) == [
        "r.yaml:1:12: link_rate: unknown rate unit 'gbitt'; did you mean 'gbit'?",
        "r.yaml:5:11: rule 'r': rate: '50%': a percentage needs a valid link_rate",
    ]


def test_all_problems_at_once():
    text = """\
        interface: "eth0/x"
        backend: htbb
        link_rate: 1gbit
        bogus: 1
        rules:
          - name: streaming
            match: {process: a-very-long-process-name, direction: in, local_port: 9000-8000}
            rate: 8mbits
          - name: streaming
            match: {procss: rsync, remote: [192.0.2.1/24, "2001:db8::/32"], user: nosuchuserfp}
            rate: 2gbit
            ceil: 1mbit
          - match: {}
            rate: 50%
          - name: x
            name: y
            match: {exe: usr/bin/x, remote_port: 80:90}
            rate: 1mbit
          - 42
        """
    assert errs(text) == [
        "r.yaml:1:12: interface: 'eth0/x': an interface name cannot contain '/' (no '/', ':', "
        "whitespace)",
        "r.yaml:2:10: backend: 'htbb' is not a backend: use auto, psp or htb; did you mean 'htb'?",
        "r.yaml:4:1: bogus: unknown key; valid keys: interface, backend, link_rate, interfaces, ready_classes, rules",
        "r.yaml:7:22: rule 'streaming': match.process: 'a-very-long-process-name' is 24 "
        "characters but the kernel's comm is at most 15: it can never match; use "
        "'a-very-long-pro' or match exe",
        "r.yaml:7:59: rule 'streaming': match.direction: 'in' is not a direction: use inbound "
        "(accepted), outbound (connected) or any",
        "r.yaml:7:75: rule 'streaming': match.local_port: '9000-8000': range start 9000 is "
        "above its end 8000",
        "r.yaml:8:11: rule 'streaming': rate: unknown rate unit 'mbits'; did you mean 'mbit'?",
        "r.yaml:9:11: rule 'streaming': name: duplicate rule name (first defined at line 6)",
        "r.yaml:10:13: rule 'streaming': match.procss: unknown key; did you mean 'process'?",
        "r.yaml:10:37: rule 'streaming': match.remote: '192.0.2.1/24' has host bits set; did "
        "you mean '192.0.2.0/24'?",
        "r.yaml:10:75: rule 'streaming': match.user: unknown user 'nosuchuserfp'",
        "r.yaml:11:11: rule 'streaming': rate: 2 Gbit/s is above link_rate 1 Gbit/s: a flow "
        "can never get it",
        "r.yaml:12:11: rule 'streaming': ceil: 1 Mbit/s is below rate 2 Gbit/s (ceil must be "
        ">= rate)",
        "r.yaml:13:5: rule #3: name: missing (required: unique name of the rule: letters, "
        "digits, '_', '.', '-')",
        "r.yaml:13:12: rule #3: match: no match fields: the rule would shape every flow of "
        "every process; give process, exe, user, ports or remote",
        "r.yaml:16:5: rule 'x': name: duplicate key (first at line 15)",
        "r.yaml:17:18: rule 'x': match.exe: 'usr/bin/x' is not an absolute path (exe must "
        "start with '/', e.g. /usr/bin/rsync or /usr/bin/python3*)",
        "r.yaml:17:42: rule 'x': match.remote_port: '80:90' is not a port or a port range "
        "(write a range as 8000-8100)",
        "r.yaml:19:5: rule #5: expected a mapping with name, match, rate; found '42'",
    ]


def test_too_many_problems_are_capped():
    text = "rules:\n" + "".join(f"  - {{name: r{i}, match: {{}}, rate: 1mbit}}\n"
                                for i in range(250))
    out = errs(text)
    assert len(out) == rules.MAX_PROBLEMS + 1
    assert out[-1] == "r.yaml:102:25: ... and 150 more problems from here on"


# ------------------------------------------------------------ YAML level

def test_yaml_syntax_errors():
    assert err("rules: [\n") == ("r.yaml:2:1: YAML syntax error: did not find expected node "
                                 "content (while parsing a flow node at line 2)")
    assert err("a: b: c\n") == "r.yaml:1:5: YAML syntax error: mapping values are not allowed " \
                                "in this context"
    assert err("rules:\n\t- a\n") == ("r.yaml:2:1: YAML syntax error: found character that "
                                      "cannot start any token (while scanning for the next "
                                      "token at line 2)")
    assert err("a: 1\n---\nb: 2\n") == ("r.yaml:2:1: YAML syntax error: but found another "
                                        "document (expected a single document in the stream at "
                                        "line 1)")


def test_aliases_are_refused():
    assert err("backend: &b htb\nlink_rate: *b\n") == \
        "r.yaml:2:12: aliases (*b) are not supported in a rules file: write the value out"
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(8))
    assert err(bomb) == \
        "r.yaml:2:8: aliases (*a) are not supported in a rules file: write the value out"


def test_deep_nesting_is_refused():
    assert err("rules: " + "[" * 100000) == "r.yaml:1:23: nesting deeper than 16 levels"


def test_tags():
    assert err("interface: !custom eth0\n") == "r.yaml:1:12: interface: unsupported YAML tag " \
                                               "'!custom'"
    assert err("!!python/object:os.system x\n").startswith(
        "r.yaml:1:1: the rules file must be a mapping with interface, backend, link_rate, interfaces, ready_classes, rules, "
        "found a value tagged 'tag:yaml.org,2002:python/object")
    assert err("<<: {interface: a}\n") == \
        "r.yaml:1:1: keys must be plain names, found a merge key '<<' (not supported: write the " \
        "keys out)"
    assert ok("interface: !!str 0\n").interface == "0"


def test_encoding_problems():
    assert err(b"interface: eth0\nbackend: \xff\n") == "r.yaml:2:10: not UTF-8 text (byte 0xff)"
    assert err("interface: e\x00th0\n") == "r.yaml:1:13: character U+0000 is not allowed in a " \
                                           "YAML file"
    assert err("backend: h\ud800tb\n") == "r.yaml:1:11: character U+D800 is not allowed in a " \
                                          "YAML file"
    assert err("é: 1\nbackend: \x01\n") == "r.yaml:2:10: character U+0001 is not allowed in a " \
                                           "YAML file"
    assert ok("\ufeffinterface: eth0\n").interface == "eth0"
    assert rules.loads(b"\xef\xbb\xbfinterface: eth0\n").interface == "eth0"


def test_size_cap():
    big = "# " + "x" * rules.MAX_BYTES + "\n{}"
    assert err(big) == "r.yaml:1:1: the file is larger than 1024 KiB; refused"
    assert err(big.encode()) == "r.yaml:1:1: the file is larger than 1024 KiB; refused"


def test_load_unreadable(tmp_path):
    missing = tmp_path / "none.yaml"
    with pytest.raises(RulesError) as ei:
        rules.load(str(missing))
    assert str(ei.value) == f"{missing}:0:0: cannot read: No such file or directory"
    with pytest.raises(RulesError) as ei:
        rules.load(str(tmp_path))
    assert str(ei.value) == f"{tmp_path}:0:0: cannot read: Is a directory"
    with pytest.raises(RulesError) as ei:
        rules.load("a\0b")
    assert str(ei.value).startswith("a\0b:0:0: cannot read: ")


def test_load_file_and_size_cap(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("interface: eth0\n")
    assert rules.load(p).path == str(p)
    p.write_bytes(b"#" * (rules.MAX_BYTES + 10))
    with pytest.raises(RulesError) as ei:
        rules.load(str(p))
    assert str(ei.value) == f"{p}:1:1: the file is larger than 1024 KiB; refused"
    p.write_bytes(b"interface: \xc3\x28\n")
    with pytest.raises(RulesError) as ei:
        rules.load(str(p))
    assert str(ei.value) == f"{p}:1:12: not UTF-8 text (byte 0xc3)"


def test_not_text():
    with pytest.raises(RulesError) as ei:
        rules.loads(42)
    assert str(ei.value) == "<string>:1:1: rules must be text, not int"


# --------------------------------------------------------- dump, describe

def test_dump_example_round_trip():
    rs = rules.load(str(ROOT / "rules/example.yaml"))
    text = rules.dump(rs)
    assert text == textwrap.dedent("""\
        interface: eth0
        backend: auto
        link_rate: 1gbit
        rules:
        - name: streaming
          match:
            process: musicd
            direction: inbound
            local_port: 8443
          rate: 8mbit
        - name: mirror-sync
          match:
            process: rsync
            remote:
            - 192.0.2.0/24
            - 2001:db8::/32
          rate: 200mbit
          ceil: 600mbit
        - name: downloads
          match:
            process: nginx
            direction: inbound
            local_port: 443
          rate: 8mbit
          ceil: 16mbit
          client_rate: 20mbit
          total_rate: 600mbit
        """)
    back = rules.loads(text, rs.path)
    assert rules.without_provenance(back) == rules.without_provenance(rs)


def test_dump_odd_values_round_trip():
    rs = RuleSet(interface="0", backend=BackendKind.PSP, link_rate_bps=187, rules=(
        Rule("yes", Match(process=("yes", "no", "*", "[x]", "1e6", "null", " a "),
                          exe=("/usr/bin/a: b", "/x #y"), user=(0, 4294967294),
                          local_port=PortSet(((1, 65535), (80, 80))),
                          remote=(ipaddress.ip_network("::/0"),
                                  ipaddress.ip_network("10.0.0.1/32"))),
             rate_bps=1, ceil_bps=187),))
    back = rules.loads(rules.dump(rs), "")
    assert back == rs                        # Rule.line and RuleSet.path do not compare
    assert back.rules[0].line > 0
    assert rules.without_provenance(back) == rs


def test_describe_example():
    rs = rules.load(str(ROOT / "rules/example.yaml"))
    assert rules.describe(rs) == [
        "interface: eth0",
        "backend: auto",
        "link_rate: 1 Gbit/s",
        "rules: 3 (first match wins; unmatched flows are not shaped)",
        f"  1. streaming (line {rs.rules[0].line}): rate 8 Mbit/s per flow, ceil none; match "
        "process=musicd direction=inbound local_port=8443",
        f"  2. mirror-sync (line {rs.rules[1].line}): rate 200 Mbit/s per flow, ceil 600 Mbit/s; "
        "match process=rsync remote=192.0.2.0/24,2001:db8::/32",
        f"  3. downloads (line {rs.rules[2].line}): rate 8 Mbit/s per flow, ceil 16 Mbit/s, "
        "client_rate 20 Mbit/s per client (/32 IPv4, /64 IPv6), total_rate 600 Mbit/s; "
        "match process=nginx direction=inbound local_port=443",
    ]
    bare = RuleSet(interface="", rules=(Rule("u", Match(user=(0,), local_port=PortSet(
        ((1, 2),))), rate_bps=125),))
    assert rules.describe(bare) == [
        "interface: (not set: give --interface)",
        "backend: auto",
        "link_rate: (from the interface's speed)",
        "rules: 1 (first match wins; unmatched flows are not shaped)",
        "  1. u: rate 1 Kbit/s per flow, ceil none; match user=root(0) local_port=1-2",
    ]


def test_protocol_and_idle_timeout():
    # issue 17: UDP rules and their idle timeout
    rs = rules.loads(rule("{protocol: udp, local_port: 4433}", "    idle_timeout: 1500ms\n"), F)
    assert rs.rules[0].match.protocol is Protocol.UDP
    assert rs.rules[0].idle_timeout_ns == 1_500_000_000
    assert match_of("{local_port: 80}").protocol is Protocol.TCP
    assert match_of("{local_port: 80, protocol: any}").protocol is Protocol.ANY
    assert rules.loads(rule("{local_port: 80}"), F).rules[0].idle_timeout_ns == 30 * 10**9
    for text, ns in (("2m", 120 * 10**9), ("1h", 3600 * 10**9), ("45", 45 * 10**9),
                     ("1.5s", 1_500_000_000)):
        assert rules.loads(rule("{local_port: 80}", f"    idle_timeout: {text}\n"),
                           F).rules[0].idle_timeout_ns == ns
    assert err(rule("{protocol: udpp, local_port: 80}")) == (
        "r.yaml:3:23: rule 'r': match.protocol: 'udpp' is not a protocol: use tcp, udp or any; "
        "did you mean 'udp'?")
    assert err(rule("{protocol: udp}")).endswith("give process, exe, user, ports or remote")
    assert err(rule("{local_port: 80}", "    idle_timeout: soon\n")) == (
        "r.yaml:5:19: rule 'r': idle_timeout: 'soon' is not a duration: write e.g. 30s, 1500ms, "
        "2m or 1h")
    assert err(rule("{local_port: 80}", "    idle_timeout: 500ms\n")) == (
        "r.yaml:5:19: rule 'r': idle_timeout: '500ms' is out of range: an idle timeout is 1s..24h")
    assert err(rule("{local_port: 80}", "    idle_timeout: 25h\n")).endswith("1s..24h")


def test_field_table_is_documented():
    doc = (ROOT / "docs/rules.md").read_text()
    block = doc.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert block == rules.fields_markdown(), "regenerate with: python -m flowpacer.policy.rules"
    seen = set()
    for section, name, default, text, example in rules.field_docs():
        assert f"`{name}`" in doc, name
        seen.add(name)
    assert {"interface", "backend", "link_rate", "interfaces", "ready_classes", "rules", "name", "match", "rate", "ceil",
            "process", "exe", "user", "direction", "local_port", "remote_port",
            "remote", "client_rate", "total_rate", "client_prefix", "ipv4", "ipv6", "protocol",
            "idle_timeout", "receive_rate", "receive_ceil"} == seen
    for unit in ("kbit", "mibit", "bps", "kibps", "tbps"):
        assert f"`{unit}`" in doc, unit


def test_every_field_has_a_message_path():
    # every declared field name appears in the FIELD position of some error
    assert os.path.exists(ROOT / "rules/example.yaml")
    for f in rules.MATCH_FIELDS:
        out = errs(rule("{%s: [[1]]}" % f.name))
        assert out[0].split(": ")[2] == f"match.{f.name}", out


@pytest.mark.parametrize("text,where", [
    ("backend: &b htb\nlink_rate: *b\n", (2, 12)),
    ("rules: " + "[" * 50, (1, 23)),
    ("é: 1\nbackend: \x01\n", (2, 10)),
    ("backend: h\ud800tb\n", (1, 11)),
    ("a: b: c\n", (1, 5)),
])
def test_pure_python_parser_agrees(text, where):
    """Without libyaml the loader falls back to PyYAML's Python parser: same checks."""
    for loader in {rules._PyLoader, rules._Loader}:
        col = rules._Collector(F)
        assert rules._compose(text, col, loader) is None
        (p,) = col.problems
        assert (p.line, p.col) == where, (loader, p)


def test_pure_python_parser_same_nodes():
    text = (ROOT / "rules/example.yaml").read_text()
    a = rules._compose(text, rules._Collector(F), rules._PyLoader)
    b = rules._compose(text, rules._Collector(F), rules._Loader)

    def shape(n):
        if isinstance(n.value, list):
            return [shape(x) if not isinstance(x, tuple) else (shape(x[0]), shape(x[1]))
                    for x in n.value]
        return (n.tag, n.value, n.start_mark.line, n.start_mark.column)
    assert shape(a) == shape(b)


# ------------------------------------------------------- aggregate rates (issue 15)

def agg(extra: str, head: str = "link_rate: 1gbit\n", rate: str = "8mbit") -> str:
    """A one-rule file (link_rate on line 1) with the extra rule fields from line 6 on."""
    return rule("{process: nginx}", textwrap.indent(textwrap.dedent(extra), "    "), rate=rate,
                head=head)


def test_aggregates_load_with_their_units():
    rs = ok(agg("""\
        ceil: 16mbit
        client_rate: 20mbit
        total_rate: 75%
        client_prefix: {ipv4: 24, ipv6: 48}
    """))
    (r,) = rs.rules
    assert (r.rate_bps, r.ceil_bps, r.client_rate_bps, r.total_rate_bps) == (
        1_000_000, 2_000_000, 2_500_000, 93_750_000)
    assert r.client_prefix == (24, 48) and r.has_groups and not rs.warnings


def test_aggregate_defaults_and_partial_prefix():
    (plain,) = ok(rule("{process: nginx}")).rules
    assert (plain.client_rate_bps, plain.total_rate_bps, plain.client_prefix) == (None, None, (32, 64))
    assert not plain.has_groups
    (r,) = ok(agg("client_rate: 8mbit\nclient_prefix: {ipv6: 56}\n")).rules
    assert r.client_prefix == (32, 56) and r.client_rate_bps == r.rate_bps
    (t,) = ok(agg("total_rate: 8mbit\n")).rules        # equal to rate is allowed
    assert t.total_rate_bps == 1_000_000 and t.client_rate_bps is None


def test_aggregate_order_errors():
    assert errs(agg("client_rate: 4mbit\ntotal_rate: 2mbit\n")) == [
        "r.yaml:6:18: rule 'r': client_rate: 4 Mbit/s is below rate 8 Mbit/s (one flow alone "
        "would exceed it; client_rate must be >= rate)",
        "r.yaml:7:17: rule 'r': total_rate: 2 Mbit/s is below rate 8 Mbit/s (total_rate must be "
        ">= rate)",
        "r.yaml:7:17: rule 'r': total_rate: 2 Mbit/s is below client_rate 4 Mbit/s (total_rate "
        "must be >= client_rate)",
    ]
    assert err(agg("client_rate: 20mbit\ntotal_rate: 10mbit\n")) == (
        "r.yaml:7:17: rule 'r': total_rate: 10 Mbit/s is below client_rate 20 Mbit/s "
        "(total_rate must be >= client_rate)")


def test_ceil_within_the_caps():
    assert err(agg("ceil: 30mbit\nclient_rate: 20mbit\n")) == (
        "r.yaml:6:11: rule 'r': ceil: 30 Mbit/s is above client_rate 20 Mbit/s (a flow cannot "
        "borrow past its client's cap; ceil must be <= client_rate)")
    assert err(agg("ceil: 30mbit\ntotal_rate: 20mbit\n")) == (
        "r.yaml:6:11: rule 'r': ceil: 30 Mbit/s is above total_rate 20 Mbit/s (a flow cannot "
        "borrow past its total's cap; ceil must be <= total_rate)")
    # a ceil below rate is reported once, as before
    assert err(agg("ceil: 1mbit\nclient_rate: 20mbit\n")) == (
        "r.yaml:6:11: rule 'r': ceil: 1 Mbit/s is below rate 8 Mbit/s (ceil must be >= rate)")


def test_aggregates_above_the_link_are_errors():
    assert errs(agg("client_rate: 2gbit\ntotal_rate: 3gbit\n")) == [
        "r.yaml:6:18: rule 'r': client_rate: 2 Gbit/s is above link_rate 1 Gbit/s: the flows "
        "together can never get it",
        "r.yaml:7:17: rule 'r': total_rate: 3 Gbit/s is above link_rate 1 Gbit/s: the flows "
        "together can never get it",
    ]


def test_client_prefix_errors():
    assert errs(agg("client_rate: 20mbit\nclient_prefix: {ipv4: 33, ipv6: x, ipv5: 1}\n")) == [
        "r.yaml:7:27: rule 'r': client_prefix.ipv4: '33' is not a prefix length (0..32)",
        "r.yaml:7:37: rule 'r': client_prefix.ipv6: 'x' is not a prefix length (0..128)",
        "r.yaml:7:40: rule 'r': client_prefix.ipv5: unknown key; did you mean 'ipv6'?",
    ]
    assert err(agg("client_rate: 20mbit\nclient_prefix: 64\n")) == (
        "r.yaml:7:20: rule 'r': client_prefix: expected a mapping like {ipv4: 32, ipv6: 64}, "
        "found '64'")
    assert err(agg("client_prefix: {ipv4: 24}\ntotal_rate: 20mbit\n")) == (
        "r.yaml:6:20: rule 'r': client_prefix: has no effect without client_rate (it says what "
        "one client is for client_rate)")
    assert err(agg("client_rate:\n")) == (
        "r.yaml:6:17: rule 'r': client_rate: no value (expected a rate like '8mbit'; remove "
        "the key to use the default)")


def test_oversubscribed_totals_are_a_warning():
    text = textwrap.dedent("""\
        link_rate: 100mbit
        rules:
          - {name: a, match: {process: a}, rate: 8mbit, total_rate: 60mbit}
          - {name: b, match: {process: b}, rate: 8mbit}
          - {name: c, match: {process: c}, rate: 8mbit, total_rate: 50mbit}
          - {name: d, match: {process: d}, rate: 8mbit, total_rate: 50mbit}
    """)
    rs = rules.loads(text, F)
    assert len(rs.rules) == 4
    assert [str(w) for w in rs.warnings] == [
        "r.yaml:5:61: rule 'c': total_rate: warning: the total_rate of the rules up to here add "
        "up to 110 Mbit/s, above link_rate 100 Mbit/s: the link is oversubscribed, a total is a "
        "cap but not a guarantee"]
    assert rules.describe(rs)[-1] == str(rs.warnings[0])
    # warnings do not change what the rules mean; no link_rate: nothing to compare with
    assert RuleSet(rs.interface, rs.backend, rs.link_rate_bps, rs.rules) == rs
    assert not rules.loads(text.replace("50mbit", "20mbit"), F).warnings   # exactly the link
    assert not rules.loads(text.split("\n", 1)[1], F).warnings


def test_aggregates_dump_round_trip():
    rs = ok(agg("""\
        ceil: 16mbit
        client_rate: 20mbit
        total_rate: 600mbit
        client_prefix: {ipv6: 56}
    """))
    text = rules.dump(rs)
    assert "client_prefix:\n    ipv4: 32\n    ipv6: 56\n" in text
    assert rules.without_provenance(rules.loads(text)) == rules.without_provenance(rs)
    plain = ok(agg("client_rate: 20mbit\n"))
    assert "client_prefix" not in rules.dump(plain)


# ----------------------------------------------------------- uploads (issue 17)

def test_receive_rate_loads_and_round_trips():
    (r,) = ok(agg("receive_rate: 10mbit\nreceive_ceil: 50%\n")).rules
    assert (r.rate_bps, r.receive_rate_bps, r.receive_ceil_bps) == (
        1_000_000, 1_250_000, 62_500_000)
    assert rules.without_provenance(rules.loads(rules.dump(ok(agg("receive_rate: 10mbit\n"))))) \
        == rules.without_provenance(ok(agg("receive_rate: 10mbit\n")))
    (plain,) = ok(rule("{process: nginx}")).rules
    assert (plain.receive_rate_bps, plain.receive_ceil_bps) == (None, None)
    assert "receive_rate 10 Mbit/s per flow (ceil none)" in rules.describe(
        ok(agg("receive_rate: 10mbit\n")))[-1]


def test_receive_rate_errors_have_their_place():
    assert errs(agg("receive_rate: 20mbit\nreceive_ceil: 10mbit\n")) == [
        "r.yaml:7:19: rule 'r': receive_ceil: 10 Mbit/s is below receive_rate 20 Mbit/s "
        "(receive_ceil must be >= receive_rate)"]
    assert err(agg("receive_ceil: 10mbit\n")) == (
        "r.yaml:6:19: rule 'r': receive_ceil: needs receive_rate (the rate a flow's uploads are "
        "guaranteed)")
    assert err(agg("receive_rate: 2gbit\n")) == (
        "r.yaml:6:19: rule 'r': receive_rate: 2 Gbit/s is above link_rate 1 Gbit/s: a flow can "
        "never get it")
    assert err(agg("receive_rate: fast\n")).startswith("r.yaml:6:19: rule 'r': receive_rate: ")


RECV_ONLY = "link_rate: 1gbit\nrules:\n  - name: r\n    match: {process: nginx}\n"


def test_receive_only_rule_loads_round_trips_and_says_so():
    """A rule with receive_rate and no rate shapes what its flows upload only (issue 17)."""
    rs = ok(RECV_ONLY + "    receive_rate: 10mbit\n    receive_ceil: 20mbit\n")
    (r,) = rs.rules
    assert (r.rate_bps, r.ceil_bps, r.receive_rate_bps, r.receive_ceil_bps) == (
        None, None, 1_250_000, 2_500_000)
    assert not r.sends and rs.receives
    text = rules.dump(rs)
    assert not re.search(r"^[ -]*rate:", text, re.M), text
    assert rules.without_provenance(rules.loads(text)) == rules.without_provenance(rs)
    assert "r (line 3): receive only (sending not shaped), receive_rate 10 Mbit/s per flow " \
           "(ceil 20 Mbit/s)" in rules.describe(rs)[-1]


def test_receive_only_rule_errors_have_their_place():
    # neither rate nor receive_rate: a problem at the rule (and receive_ceil's own)
    assert errs(RECV_ONLY + "    receive_ceil: 20mbit\n") == [
        "r.yaml:3:5: rule 'r': rate: missing: give rate (what each flow is sent), receive_rate "
        "(what each flow may upload), or both",
        "r.yaml:5:19: rule 'r': receive_ceil: needs receive_rate (the rate a flow's uploads are "
        "guaranteed)"]
    # a refused receive_rate is its own problem, not also "missing"
    assert err(RECV_ONLY + "    receive_rate: fast\n").startswith(
        "r.yaml:5:19: rule 'r': receive_rate: ")
    # what shapes the send side needs rate
    assert errs(RECV_ONLY + "    receive_rate: 10mbit\n    ceil: 20mbit\n"
                "    client_rate: 20mbit\n    total_rate: 30mbit\n") == [
        f"r.yaml:{n}:{c}: rule 'r': {k}: needs rate (it shapes what is sent; this rule has "
        "receive_rate only)" for n, c, k in ((6, 11, "ceil"), (7, 18, "client_rate"),
                                             (8, 17, "total_rate"))]


# ------------------------------------------- units that bite, rules that cannot win (issue 28)

BYTE_UNITS = """\
    interface: eth0
    link_rate: 125mbps
    rules:
      - name: radio
        match: {process: icecast}
        rate: 320kbps  # a 320 kbit/s stream
      - name: dl
        match: {process: nginx}
        rate: 10mbit
        ceil: 10mbps
"""


def test_byte_units_load_with_a_warning_at_the_value():
    rs = ok(BYTE_UNITS)
    assert rs.link_rate_bps == 125_000_000 and rs.rules[0].rate_bps == 320_000
    assert rs.rules[1].ceil_bps == 10_000_000
    assert [str(w) for w in rs.warnings] == [
        "r.yaml:2:12: link_rate: warning: '125mbps' uses tc's byte unit 'mbps': 125 megabytes/s "
        "= 1 Gbit/s (the reading used), not 125 megabits/s = 125 Mbit/s; write '125mbit' for "
        "bits, or '1gbit' to keep 1 Gbit/s without this warning",
        "r.yaml:6:11: rule 'radio': rate: warning: '320kbps' uses tc's byte unit 'kbps': 320 "
        "kilobytes/s = 2.56 Mbit/s (the reading used), not 320 kilobits/s = 320 Kbit/s; write "
        "'320kbit' for bits, or '2560kbit' to keep 2.56 Mbit/s without this warning",
        "r.yaml:10:11: rule 'dl': ceil: warning: '10mbps' uses tc's byte unit 'mbps': 10 "
        "megabytes/s = 80 Mbit/s (the reading used), not 10 megabits/s = 10 Mbit/s; write "
        "'10mbit' for bits, or '80mbit' to keep 80 Mbit/s without this warning"]
    assert rs.warnings[1].line == 6 and rs.warnings[1].col == 11


def test_strict_units_refuse_every_byte_unit_at_once():
    with pytest.raises(RulesError) as ei:
        rules.loads(textwrap.dedent(BYTE_UNITS), F, strict_units=True)
    got = [(p.line, p.col, p.message.split(":")[0]) for p in ei.value.problems]
    assert got == [(2, 12, "link_rate"), (6, 11, "rule 'radio'"), (10, 11, "rule 'dl'")]
    assert all("(strict units)" in p.message and "warning" not in p.message
               for p in ei.value.problems)


def test_a_bit_unit_file_has_no_warning_in_either_mode():
    text = BYTE_UNITS.replace("mbps", "mbit").replace("kbps", "kbit")
    assert ok(text).warnings == ()
    assert rules.loads(textwrap.dedent(text), F, strict_units=True).warnings == ()


def test_rate_spelled_as_people_write_it_gets_the_tc_spelling():
    assert errs("""\
        interface: eth0
        rules:
          - {name: a, match: {process: a}, rate: 10 Mbit/s}
          - {name: b, match: {process: b}, rate: 10 Mbps}
    """) == [
        "r.yaml:3:42: rule 'a': rate: '10 Mbit/s' is not a tc rate: write '10mbit'",
        "r.yaml:4:42: rule 'b': rate: '10 Mbps': no space between number and unit, and 'Mbps' "
        "is tc's BYTES per second: write '10mbit' for 10 megabits/s ('10mbps' is tc's 10 "
        "megabytes/s, 8 times as much)"]


LINTS = """\
    interface: eth0
    rules:
      - name: nginx
        match: {process: nginx}
        rate: 8mbit
      - name: nginx-hifi
        match: {process: nginx, local_port: 8443}
        rate: 20mbit
      - name: web-any
        match: {local_port: [80, 443]}
        rate: 8mbit
      - name: web-v4
        match: {local_port: 443, remote: 192.0.2.0/24, direction: inbound}
        rate: 8mbit
        idle_timeout: 10s
      - name: mapped
        match: {remote: ["::ffff:198.51.100.0/120", 2001:db8::/32], protocol: any}
        rate: 8mbit
        idle_timeout: 10s
      - name: narrow-first
        match: {process: curl, local_port: 8443}
        rate: 8mbit
      - name: wide-after
        match: {process: curl}
        rate: 8mbit
"""


def test_shadowed_rules_ignored_fields_and_mapped_networks_warn_with_positions():
    rs = ok(LINTS)
    assert [r.name for r in rs.rules][:2] == ["nginx", "nginx-hifi"]      # still loads
    assert [str(w) for w in rs.warnings] == [
        "r.yaml:7:12: rule 'nginx-hifi': match: warning: never matches: rule 'nginx' (line 3) "
        "comes first and matches every flow this rule does (first match wins; put the "
        "narrower rule first)",
        "r.yaml:13:12: rule 'web-v4': match: warning: never matches: rule 'web-any' (line 9) "
        "comes first and matches every flow this rule does (first match wins; put the "
        "narrower rule first)",
        "r.yaml:15:19: rule 'web-v4': idle_timeout: warning: ignored: idle_timeout is for UDP "
        "flows (a TCP flow ends when it closes); this rule matches TCP only (give protocol: "
        "udp or any)",
        "r.yaml:17:22: rule 'mapped': match.remote: warning: '::ffff:198.51.100.0/120' never "
        "matches: an IPv4-mapped address is the IPv4 address it carries, as on the wire (write "
        "'198.51.100.0/24')"]


@pytest.mark.parametrize("outer,inner,shadowed", [
    ("{process: nginx}", "{process: nginx, user: 0}", True),
    ("{process: 'ngin*'}", "{process: nginx}", True),
    ("{process: nginx}", "{process: 'ngin*'}", False),          # the glob matches more
    ("{process: [a, b]}", "{process: b, direction: outbound}", True),
    ("{local_port: 8000-8100}", "{local_port: [8001, 8050-8060]}", True),
    ("{local_port: 8000-8100}", "{local_port: 8050-8200}", False),
    ("{local_port: [1-100, 101-200]}", "{local_port: 50-150}", True),
    ("{remote: 10.0.0.0/8}", "{remote: 10.1.0.0/16, process: x}", True),
    ("{remote: 10.0.0.0/8}", "{remote: ['10.1.0.0/16', '2001:db8::/32']}", False),
    ("{user: [0, 33]}", "{user: 33, process: x}", True),
    ("{user: 33}", "{process: x}", False),
    ("{process: x, protocol: any}", "{process: x, protocol: udp}", True),
    ("{process: x}", "{process: x, protocol: any}", False),    # tcp does not cover udp
    ("{process: x, direction: inbound}", "{process: x}", False),
    ("{exe: /usr/bin/rsync}", "{exe: /usr/bin/rsync, user: 0}", True),
])
def test_shadowing_is_said_only_when_certain(outer, inner, shadowed):
    rs = ok(f"""\
        interface: eth0
        rules:
          - {{name: a, match: {outer}, rate: 8mbit}}
          - {{name: b, match: {inner}, rate: 8mbit}}
    """)
    said = any("never matches: rule 'a'" in str(w) for w in rs.warnings)
    assert said is shadowed
    if shadowed:     # the engine agrees: every flow b matches, a matches first
        from flowpacer.policy import engine
        assert engine.covers(rs.rules[0], rs.rules[1])


def test_idle_timeout_on_udp_or_any_is_not_ignored():
    rs = ok("""\
        interface: eth0
        rules:
          - {name: u, match: {process: x, protocol: udp}, rate: 8mbit, idle_timeout: 5s}
          - {name: a, match: {process: y, protocol: any}, rate: 8mbit, idle_timeout: 5s}
    """)
    assert rs.warnings == ()


# ------------------------------------------------------ several interfaces (issue 29)

def test_interfaces_take_names_globs_and_mappings():
    from flowpacer.model import InterfaceSpec
    rs = ok("""\
        link_rate: 100mbit
        interfaces:
          - eth0
          - {name: eth1, link_rate: 10gbit}
          - "bond0.*"
        rules: [{name: a, match: {local_port: 80}, rate: 10%}]
        """)
    assert rs.interface == "" and rs.interfaces == (
        InterfaceSpec("eth0"), InterfaceSpec("eth1", 1_250_000_000), InterfaceSpec("bond0.*"))
    assert [i.is_glob for i in rs.interfaces] == [False, False, True]
    assert rs.rules[0].rate_bps == 1_250_000          # % stays of the top-level link_rate
    assert rules.without_provenance(rules.loads(rules.dump(rs), F)) == \
        rules.without_provenance(rs)
    assert rules.describe(rs)[0] == \
        "interfaces: eth0, eth1 (10 Gbit/s), bond0.* (each flow on the interface it leaves by)"
    assert ok("interfaces: eth3\n").interfaces == (InterfaceSpec("eth3"),)
    assert ok("interface: eth0\n").interfaces == ()       # the single interface, as before


def test_interfaces_errors_are_placed():
    assert errs("""\
        interfaces:
          - eth0
          - {name: eth1, link_rate: 10%, speed: 3}
          - eth0
          - [x]
          - "a/b"
          - {link_rate: 1gbit}
        """) == [
        "r.yaml:3:29: interfaces: link_rate: '10%': link_rate cannot be a percentage "
        "(give e.g. '1gbit')",
        "r.yaml:3:34: interfaces: speed: unknown key; valid keys: name, link_rate",
        "r.yaml:4:5: interfaces: 'eth0' is listed twice (first at line 2)",
        "r.yaml:5:5: interfaces: expected an interface name, a glob or a mapping "
        "{name: ..., link_rate: ...}, found a list",
        "r.yaml:6:5: interfaces: 'a/b': an interface name cannot contain '/' "
        "(no '/', ':', whitespace)",
        "r.yaml:7:5: interfaces: name: missing (required: the interface's name or a glob "
        "like 'eth*')"]
    assert err("interface: eth0\ninterfaces: [eth1]\n") == \
        "r.yaml:2:13: interfaces: give either 'interface' or 'interfaces', not both"
    assert err("interfaces: []\n").startswith("r.yaml:1:13: interfaces: empty list")
    assert err("interfaces: {name: eth0}\n") == \
        "r.yaml:1:13: interfaces: expected a list of interfaces, found a mapping"


def test_libyamls_own_nesting_limit_gives_the_same_answer(monkeypatch):
    """libyaml >= 0.2.5 (PyPI's PyYAML wheels; found by trixie's make check in a venv that
    pip filled) refuses 1000 levels while it scans ahead, before the composer reaches level 17:
    the answer must not depend on the libyaml underneath."""
    from yaml.error import Mark
    from yaml.scanner import ScannerError

    class NewLibyaml:
        def __init__(self, text):
            m = Mark("<unicode string>", 0, 0, 1006, None, None)
            raise ScannerError("while increasing flow level", m, "exceeded maximum nesting depth", m)

    monkeypatch.setattr(rules, "_Loader", NewLibyaml)
    assert err("rules: " + "[" * 100000) == "r.yaml:1:23: nesting deeper than 16 levels"
