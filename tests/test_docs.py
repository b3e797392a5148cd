"""The docs agree with the product (issue 28 item 7): every command, option, capability, metric,
environment variable and rules field named in README.md, docs/*.md and the man pages is checked
against the code: the click command tree of flowpacer.surfaces.cli (read at run time, so options
added later are checked too), the metrics a collector exports, the unit's capability set, the
environment lookups of the code, and the rules loader's field declarations. And the other way:
every command and option is in flowpacer(8), every rules field in flowpacer-rules(5), every
metric family and every environment variable the product reads is documented."""
import ast
import glob
import os
import re
import shlex

import click
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from flowpacer.kernel.backend.handles import FIRST_FLOW_MINOR, LAST_FLOW_MINOR
from flowpacer.model import (ClassStats, FirstByteCounters, FirstBytePool, FirstByteView,
                             GroupKind, GroupView, Side)
from flowpacer.policy import rules as rules_loader
from flowpacer.surfaces import metrics
from flowpacer.surfaces.cli import main as cli_main
from harness.metricsview import daemon_view as _view, flow_view as _flow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MD = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAN8 = os.path.join(ROOT, "docs", "man", "flowpacer.8")
MAN5 = os.path.join(ROOT, "docs", "man", "flowpacer-rules.5")
UNIT = os.path.join(ROOT, "systemd", "flowpacer.service")
# design notes and measurements: they name internals (kernel symbols, test-kit variables), not
# the product's interface, and are checked only for metrics and commands
NOTES = {"design.md", "psp-results.md", "firstbyte.md", "reliability.md"}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def man_plain(path):
    """A man page's text without roff: macros dropped, escapes resolved, quotes removed."""
    return man_plain_text(read(path))


def man_plain_text(text):
    out = []
    for line in text.splitlines():
        if line.startswith(".\\\"") or line.startswith("'\\\""):
            continue
        if line.startswith("."):
            m = re.match(r"\.(\w+)\s*(.*)", line)
            if not m:
                continue
            macro, rest = m.groups()
            if macro in ("TH", "SH", "SS", "TP", "PP", "RS", "RE", "br", "nf", "fi", "TS", "TE",
                         "IP", "LP", "P"):
                line = rest if macro in ("SH", "SS", "TH") else ""
            else:                                    # font macros: the words, spaces joined
                words = shlex.split(rest.replace("\\", "\\\\")) if rest else []
                line = ("" if macro in ("BR", "RB", "IR", "RI", "BI", "IB") else " ").join(words) \
                    if macro in ("BR", "RB", "IR", "RI", "BI", "IB") else " ".join(words)
        line = re.sub(r"\\f[BIRP]|\\%|\\&", "", line)
        line = line.replace("\\\\", "\\").replace("\\-", "-").replace("\\ ", " ")
        out.append(line)
    return "\n".join(out)


def man_command_lines(path):
    """The lines of a man page that show commands: bold text (.B, .BR, .RB, .BI) and the lines
    of .nf blocks, as plain text."""
    out, nf = [], False
    for line in read(path).splitlines():
        if line.startswith((".nf", ".fi")):
            nf = line.startswith(".nf")
            continue
        if nf or re.match(r"\.(B|BR|RB|BI)\s", line):
            out.append(man_plain_line(line))
    return out


def man_plain_line(line):
    return man_plain_text(line)


def doc_texts(with_notes=True):
    out = {os.path.basename(p): read(p) for p in MD
           if with_notes or os.path.basename(p) not in NOTES}
    out["flowpacer.8"] = man_plain(MAN8)
    out["flowpacer-rules.5"] = man_plain(MAN5)
    return out


# ------------------------------------------------------------------ the command line

def command_tree():
    """{("rules", "check"): click command, ...}, the group itself under ()."""
    out = {}

    def walk(cmd, path):
        out[path] = cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, path + (name,))
    walk(cli_main, ())
    return out


def options_of(cmd):
    names = {"-h", "--help"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names |= set(p.opts) | set(p.secondary_opts)
    return names


def command_lines(name, text, man_path=None):
    """(where, tokens after 'flowpacer') of each flowpacer command line the doc shows: lines of
    code blocks and inline code spans (markdown), lines of the man page, ExecStart= lines."""
    if name.endswith(".md"):
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
        pieces = [ln for b in blocks for ln in b.splitlines()]
        no_blocks = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
        pieces += re.findall(r"`([^`\n]+)`", no_blocks)
    else:
        pieces = man_command_lines(man_path)
    for piece in pieces:
        s = piece.strip()
        s = re.sub(r"^(?:[$#] |sudo )", "", s)
        s = re.sub(r"^ExecStart=-?", "", s)
        m = re.match(r"(?:\S*/)?flowpacer(?:\s+(.*))?$", s)
        if not m or s.startswith(("flowpacer:", "flowpacer_")):
            continue
        rest = m.group(1) or ""
        rest = re.split(r"\s+#\s", rest)[0]           # a shell comment
        yield piece, [t.rstrip(".,;:") for t in rest.replace("\\|", "|").split()]


def resolve(tokens):
    """(command path, its click command, the tokens after it); None for an unknown command."""
    tree = command_tree()
    path = ()
    i = 0
    while i < len(tokens) and path + (tokens[i],) in tree:
        path += (tokens[i],)
        i += 1
    cmd = tree[path]
    if getattr(cmd, "commands", None) and i < len(tokens) and re.match(r"[a-z]", tokens[i]):
        return None
    return path, cmd, tokens[i:]


OPTION = re.compile(r"(?<![\w/.-])(--?[a-zA-Z][\w.-]*)")


def test_every_command_line_in_the_docs_is_a_real_command_with_real_options():
    bad = []
    n = 0
    mans = {"flowpacer.8": MAN8, "flowpacer-rules.5": MAN5}
    for name, text in doc_texts().items():
        for where, tokens in command_lines(name, text, mans.get(name)):
            r = resolve(tokens)
            if r is None:
                bad.append(f"{name}: unknown command: {where}")
                continue
            path, cmd, rest = r
            n += 1
            known = options_of(cmd) | (options_of(cli_main) if path == () else set())
            for tok in rest:
                for opt in OPTION.findall(tok.strip("[]|()")):
                    opt = opt.split("=")[0].rstrip(".")
                    if opt not in known:
                        bad.append(f"{name}: flowpacer {' '.join(path)}: no option {opt}: {where}")
    assert n > 30
    assert not bad, "\n".join(bad)


def test_every_command_and_option_is_in_the_man_page_and_every_command_in_the_readme():
    man = man_plain(MAN8)
    readme = read(os.path.join(ROOT, "README.md"))
    missing = []
    for path, cmd in command_tree().items():
        if not path or getattr(cmd, "commands", None):
            continue
        words = " ".join(path)
        if not re.search(rf"\b{re.escape(words)}\b", man):
            missing.append(f"flowpacer(8): command {words}")
        if f"flowpacer {words}" not in readme:
            missing.append(f"README.md: command {words}")
        for opt in options_of(cmd) - {"-h", "--help"}:
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", man):
                missing.append(f"flowpacer(8): flowpacer {words} {opt}")
    for opt in options_of(cli_main) - {"-h", "--help"}:
        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", man):
            missing.append(f"flowpacer(8): flowpacer {opt}")
    assert not missing, "\n".join(missing)


def test_man_page_options_exist():
    """Every --option flowpacer(8) names belongs to some flowpacer command (lines about other
    programs, systemctl, journalctl, man, left out)."""
    known = set().union(*(options_of(c) for c in command_tree().values()))
    bad = []
    for line in man_plain(MAN8).splitlines():
        if re.search(r"\b(systemctl|journalctl|man|apt-get|dpkg)\b", line):
            continue
        bad += [o for o in OPTION.findall(line) if o.rstrip(".") not in known]
    assert not bad, bad


# ------------------------------------------------------------------ metrics

def exported_metrics():
    """Sample and family names of a scrape of a collector that has something in every
    family: flows on both sides, rule and client groups, first-byte pools."""
    flows = [_flow(0), _flow(1)]
    import dataclasses
    flows.append(dataclasses.replace(flows[0], side=Side.RECEIVE))
    groups = (GroupView(GroupKind.RULE, "r", "f1f0:100", 1000, 2000),
              GroupView(GroupKind.CLIENT, "r/10.0.0.2/32", "f1f0:101", 100, 200))
    fb = FirstByteView((FirstBytePool("r", 4, 1),), FirstByteCounters(), 0, 0)
    view = _view(flows, groups=groups, first_byte=fb)
    stats = {f.stats_key("eth0"): ClassStats(bytes=1, packets=1) for f in flows}
    reg = CollectorRegistry(auto_describe=False)
    reg.register(metrics.FlowpacerCollector(lambda: view, lambda: stats, addresses="full"))
    text = generate_latest(reg).decode()
    samples = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines()
               if ln and not ln.startswith("#")}
    families = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    bases = {re.sub(r"_total$", "", f) for f in families}
    return samples, families | bases


METRIC = re.compile(r"\bflowpacer_[a-z][a-z0-9_]*[a-z0-9]\b\*?")


def test_every_metric_named_in_the_docs_is_exported():
    samples, families = exported_metrics()
    assert "flowpacer_rule_sent_bytes_total" in samples and "flowpacer_build_info" in samples
    names = samples | families
    bad = []
    for name, text in doc_texts().items():
        for m in METRIC.findall(text):
            if m.endswith("*"):
                if not any(n.startswith(m[:-1]) for n in names):
                    bad.append(f"{name}: {m}")
            elif m not in names:
                bad.append(f"{name}: {m}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_every_exported_metric_is_documented_in_operating_md():
    samples, families = exported_metrics()
    doc = read(os.path.join(ROOT, "docs", "operating.md"))
    named = set(METRIC.findall(doc))
    missing = []
    for s in sorted(samples):
        base = re.sub(r"_(total|bucket|count|sum|created)$", "", s)
        if not ({s, base, base + "_total"} & named):
            missing.append(s)
    assert not missing, f"docs/operating.md's metrics table lacks: {missing}"


# ------------------------------------------------------------------ capabilities

def unit_capabilities():
    m = re.search(r"^CapabilityBoundingSet=(.*)$", read(UNIT), re.M)
    return set(m.group(1).split())


# a clause that names capabilities the daemon does NOT need (or needs only elsewhere)
NOT_NEEDED = re.compile(r"not needed|not need|older kernels|only to mount|without|drop-in|"
                        r"cannot mount|not ", re.I)
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def capability_texts():
    out = doc_texts(with_notes=False)
    # the daemon's own words when it refuses to start without root
    src = read(os.path.join(ROOT, "flowpacer", "surfaces", "cli.py"))
    out["cli.py"] = " | ".join(n.value for n in ast.walk(ast.parse(src))
                             if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return out


def test_capabilities_named_in_the_docs_are_the_units():
    caps = unit_capabilities()
    assert "CAP_NET_ADMIN" in caps and "CAP_SYS_ADMIN" not in caps
    real = set(re.findall(r"#define (CAP_[A-Z_]+)\s+\d+", read("/usr/include/linux/capability.h"))) \
        if os.path.exists("/usr/include/linux/capability.h") else None
    bad = []
    for name, text in capability_texts().items():
        flat = re.sub(r"\s+", " ", text.replace("`", ""))
        for clause in re.split(r"(?<=[a-z0-9)])\.\s|[;|]", flat):
            named = set(re.findall(r"\bCAP_[A-Z_]+\b", clause))
            if real is not None and named - real:
                bad.append(f"{name}: no such capability {named - real}: {clause.strip()}")
            if named and not NOT_NEEDED.search(clause) and not named <= caps:
                bad.append(f"{name}: {sorted(named - caps)} claimed, the unit has "
                           f"{sorted(caps)}: {clause.strip()}")
        for word in re.findall(r"\b(\w+) capabilities\b", text):
            if word.lower() in NUMBERS and NUMBERS[word.lower()] != len(caps):
                bad.append(f"{name}: '{word} capabilities', the unit has {len(caps)}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ environment variables

def env_lookups(paths):
    names = set()
    pat = re.compile(r"""(?:environ(?:\.get|\.pop|\.setdefault)?\s*[\(\[]\s*|getenv\s*\(\s*|"""
                     r"""\benv\.get\s*\(\s*)["']([A-Z][A-Z0-9_]*)["']""")
    # for var in ("VISUAL", "EDITOR"): ... env.get(var) / os.environ.pop(var)
    loop = re.compile(r"for (\w+) in \(([^)]*)\):((?:\n[^\n]*){1,3})")
    for p in paths:
        text = read(p)
        names |= set(pat.findall(text))
        for var, items, body in loop.findall(text):
            if re.search(rf"env(?:iron)?(?:\.get|\.pop)?\s*[\(\[]\s*{var}\b", body):
                names |= set(re.findall(r"[\"']([A-Z][A-Z0-9_]*)[\"']", items))
    return names


def code_files(*parts):
    out = []
    for part in parts:
        out += glob.glob(os.path.join(ROOT, part, "**", "*.py"), recursive=True)
    return out


def test_environment_variables_in_the_docs_are_read_by_the_code_and_the_products_are_documented():
    product = env_lookups(code_files("flowpacer"))
    assert "FLOWPACER_NO_FIRST_BYTE" in product and "VISUAL" in product
    everywhere = product | env_lookups(code_files("harness", "bench", "vm", "tests", "tools"))
    shell = "".join(read(p) for p in glob.glob(os.path.join(ROOT, "tools", "*.sh"))
                    + [os.path.join(ROOT, "Makefile")])
    everywhere |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", shell))
    everywhere |= set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", shell, re.M))
    # journald fields the daemon's records carry (surfaces/logs.py: ``extra`` keys and field
    # dicts named FLOWPACER_*): documented for journalctl, not read from the environment
    journal = set()
    for p in code_files("flowpacer"):
        journal |= set(re.findall(r"[\"'](FLOWPACER_[A-Z0-9_]+)[\"']\s*(?::|\]\s*=)", read(p)))
    assert "FLOWPACER_RULE" in journal
    bad = []
    for name, text in doc_texts().items():
        for var in set(re.findall(r"\bFLOWPACER_[A-Z0-9_]+\b", text)):
            if var not in everywhere and var not in journal:
                bad.append(f"{name}: {var} is read nowhere (and is no journal field of ours)")
    man = man_plain(MAN8)
    env_section = man.split("ENVIRONMENT", 1)[1].split("EXAMPLES", 1)[0]
    for var in product:
        if not re.search(rf"\b{var}\b", env_section):
            bad.append(f"flowpacer(8) ENVIRONMENT lacks {var} (read by flowpacer/)")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ rules fields, facts

def man_terms(path):
    """The terms of a man page's .TP entries (the line after .TP), plain, split at commas."""
    lines = read(path).splitlines()
    out = set()
    for i, line in enumerate(lines[:-1]):
        if line.startswith(".TP"):
            out |= {t.strip() for t in man_plain_text(lines[i + 1]).split(",") if t.strip()}
    return out


def test_rules_man_page_has_every_field():
    """Each field of the loader's declarations has its own entry in flowpacer-rules(5) (the
    client_prefix keys are described in its entry); every entry there is a field."""
    man = man_plain(MAN5)
    terms = man_terms(MAN5)
    fields = [(sec, field) for sec, field, *_ in rules_loader.field_docs()]
    missing = [f"{sec}: {f}" for sec, f in fields if sec != "client_prefix" and f not in terms]
    missing += [f"{sec}: {f}" for sec, f in fields if sec == "client_prefix"
                and not re.search(rf"\b{f}\b", man.split("client_prefix", 1)[1])]
    assert not missing, missing
    names = {f for _, f in fields}
    entries = {t for t in terms if re.fullmatch(r"[a-z_]+", t)}
    assert entries and entries <= names, entries - names
    assert "TCP flows flowpacer paces" not in man and "UDP" in man.split("DESCRIPTION")[0] + \
        man.split("DESCRIPTION")[1][:2000]


def test_facts_stated_where_an_admin_looks():
    readme = read(os.path.join(ROOT, "README.md"))
    man = man_plain(MAN8)
    limit = LAST_FLOW_MINOR - FIRST_FLOW_MINOR + 1
    shown = f"{limit // 1000} {limit % 1000:03d}"
    for name, text in (("README.md", readme), ("flowpacer.8", man)):
        assert shown in text, f"{name}: the class-id limit ({shown}) is not stated"
        assert "--take-over" in text and re.search(r"handle 0", text), name
    req = re.search(r"^## Requirements\n(.*?)^## ", readme, re.M | re.S)
    assert req, "README.md has no Requirements section"
    body = req.group(1)
    for needed in ("Debian 12", "Debian 13", "cgroup v2", "amd64", "kernel"):
        assert needed in body, f"Requirements lacks {needed}"
    # the .deb's unit runs /usr/bin/flowpacer (debian/rules); a drop-in must name that one
    op = read(os.path.join(ROOT, "docs", "operating.md"))
    assert "s#/opt/flowpacer/bin/flowpacer#/usr/bin/flowpacer#" in read(
        os.path.join(ROOT, "debian", "rules"))
    execs = re.findall(r"^ExecStart=(\S+)", op, re.M)
    assert "/usr/bin/flowpacer" in execs, execs
    assert set(execs) <= {"", "/usr/bin/flowpacer", "/opt/flowpacer/bin/flowpacer"}, execs


def test_the_doc_checks_can_fail():
    """The extractors find what they look for (a checker that finds nothing passes anything)."""
    lines = list(command_lines("x.md", "```sh\nflowpacer rules check --bogus F\n```\n"
                                       "`flowpacer frobnicate`"))
    assert [t for _, t in lines] == [["rules", "check", "--bogus", "F"], ["frobnicate"]]
    assert resolve(["frobnicate"]) is None
    path, cmd, rest = resolve(["rules", "check", "--bogus", "F"])
    assert path == ("rules", "check") and "--bogus" not in options_of(cmd)
    assert "Mind" in man_plain(MAN5) and "--take-over" in man_plain(MAN8)
    assert METRIC.findall("see flowpacer_rule_flows and flowpacer_0.1.0_all.deb") == \
        ["flowpacer_rule_flows"]
    assert env_lookups([__file__]) >= {"FOO_BAR"}    # os.environ.get("FOO_BAR") below
    if False:      # pragma: no cover
        os.environ.get("FOO_BAR")
