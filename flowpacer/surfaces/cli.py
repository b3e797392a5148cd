"""Command line: ``flowpacer run | status | reload | top | rules check | rules edit | cleanup``.

Exit status: 0 success, 1 a one-line failure, 2 invalid rules (every problem printed as
``FILE:LINE:COL: ...``). No traceback for any expected failure.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import click

from flowpacer.surfaces.control import DEFAULT_SOCKET, call
from flowpacer.errors import FlowpacerError, RulesError
from flowpacer.model import BackendKind, Side
from flowpacer.text import printable
from flowpacer.units import format_bit_rate, format_bytes
from flowpacer.surfaces.view import parse_explain, parse_reload, parse_status, parse_unshaped


def _setup_logging(verbose: int) -> None:
    from flowpacer.surfaces import logs
    logs.setup(verbose)


def version() -> str:
    """The installed distribution's version; from a checkout that was never installed,
    pyproject.toml's."""
    from importlib import metadata
    try:
        return metadata.version("flowpacer")
    except metadata.PackageNotFoundError:
        pass
    import re
    here = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
    try:
        with open(here, encoding="utf-8") as f:
            m = re.search(r'^version = "([^"]+)"', f.read(), re.M)
    except OSError:
        m = None
    return m.group(1) if m else "unknown"


def _fail(msg: str, code: int = 1):
    click.echo(f"flowpacer: {printable(msg)}", err=True)
    sys.exit(code)


def _rules_fail(e: RulesError):
    for p in e.problems:
        click.echo(printable(str(p)), err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version(), "-V", "--version", prog_name="flowpacer",
                      message="%(prog)s %(version)s")
def main():
    """Per-flow precise pacing for delivery servers."""


@main.command()
@click.option("--rules", "rules_path", required=True, type=click.Path(dir_okay=False),
              help="rules file (YAML)")
@click.option("--interface", help="egress interface (overrides the rules file)")
@click.option("--backend", type=click.Choice([k.value for k in BackendKind]),
              help="pacing backend (overrides the rules file)")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--take-over", is_flag=True, help="replace a root qdisc flowpacer did not create")
@click.option("--rescan", default=1.0, show_default=True, type=click.FloatRange(0.05, 3600),
              help="sock_diag reconcile period, seconds")
@click.option("--no-tracer", is_flag=True, help="find flows by sock_diag polling only")
@click.option("--metrics", "metrics_listen", default="127.0.0.1:9717", show_default=True,
              metavar="HOST:PORT|unix:/PATH",
              help="Prometheus endpoint (loopback unless told otherwise); unix:/PATH listens on "
                   "a Unix socket of mode 0660 with its directory's group")
@click.option("--no-metrics", is_flag=True, help="no Prometheus endpoint")
@click.option("--metrics-max-flows", default=10_000, show_default=True, type=click.IntRange(0),
              help="at most this many per-flow series (the busiest flows); the rest are counted "
                   "as overflow")
@click.option("--metrics-addresses", default="prefix", show_default=True,
              type=click.Choice(["full", "prefix", "none"]),
              help="address labels of the per-flow and per-client series: as they are (with "
                   "both ports), their /24 or /48 network (with the service's port only), or "
                   "none (no ports, no client series)")
@click.option("--web.config.file", "web_config_file", type=click.Path(dir_okay=False),
              help="TLS and basic auth of the metrics endpoint (Prometheus exporter web "
                   "configuration file)")
@click.option("--strict-units", is_flag=True,
              help="refuse rates in tc's byte units (kbps, mbps: BYTES per second) instead of "
                   "warning about them")
@click.option("--keep-on-exit", is_flag=True,
              help="on SIGTERM leave the qdisc, classes and filters for the next start to adopt "
                   "(a restart without a gap; the systemd unit sets FLOWPACER_KEEP_ON_EXIT=1, "
                   "the same, and removes them on stop)")
@click.option("-v", "--verbose", count=True,
              help="debug records of flowpacer (-vv: of its libraries too)")
def run(rules_path, interface, backend, socket_path, take_over, rescan, no_tracer, metrics_listen,
        no_metrics, metrics_max_flows, metrics_addresses, web_config_file, strict_units,
        keep_on_exit, verbose):
    """Run the daemon: shape each matched flow until stopped (SIGTERM removes everything it
    made, unless --keep-on-exit)."""
    _setup_logging(verbose)
    if os.geteuid() != 0:
        _fail("run needs root (CAP_NET_ADMIN for tc, CAP_BPF and CAP_PERFMON for the tracer, "
              "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH to find sockets' owners)")
    from flowpacer.daemon.app import Daemon, Options
    d = Daemon(Options(rules_path, interface, BackendKind(backend) if backend else None,
                       socket_path, take_over, rescan, not no_tracer,
                       None if no_metrics else metrics_listen, metrics_max_flows,
                       metrics_addresses, web_config_file,
                       # benchmarks' "before" figures: flows get their class after the handshake
                       first_byte=not os.environ.get("FLOWPACER_NO_FIRST_BYTE"),
                       strict_units=strict_units,
                       keep_on_exit=keep_on_exit
                       or os.environ.get("FLOWPACER_KEEP_ON_EXIT", "") not in ("", "0")))
    try:
        d.start()
    except RulesError as e:
        d.shutdown()
        _rules_fail(e)
    except FlowpacerError as e:
        d.shutdown()
        _fail(str(e))
    try:
        d.run()
    finally:
        d.shutdown()
    if d.exit_code:
        sys.exit(d.exit_code)      # a stage gave up: systemd's Restart=on-failure starts us again


def _echo_module_line() -> None:
    """The module a psp backend needs: who signed its file, whether it is loaded, what this
    kernel demands of signatures (issue 27.5; read here with modinfo, not from the daemon)."""
    from flowpacer.kernel.backend import module_report, registry
    for s in registry.auto_order():
        line = module_report(s.module) if s.module else ""
        if line:
            click.echo(f"module:    {printable(line)}")


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "all_flows", is_flag=True,
              help="also every live flow that has no class, and why")
def status(socket_path, as_json, all_flows):
    """Show the backend and every shaped flow of the running daemon."""
    try:
        st = call(socket_path, {"cmd": "status", "all": True} if all_flows else {"cmd": "status"})
    except FlowpacerError as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    try:
        a = parse_status(st)
    except ValueError as e:
        _fail(f"{socket_path}: {e}")
    click.echo(f"backend:   {printable(a.backend)} ({printable(a.backend_reason)})")
    src = a.link_rate_source
    click.echo(f"interface: {printable(a.interface)}, link {format_bit_rate(a.link_rate_bit)}"
               + (f" ({printable(src)})" if src not in ("", "rules", "speed") else ""))
    _echo_module_line()
    if a.backend_state != "ok":
        click.echo(f"state:     {printable(a.backend_state)}"
                   + (f" (cannot rebuild, {a.rebuild_failures} attempts failed: "
                      f"{printable(a.backend_problem)})" if a.backend_problem else ""))
    if len(a.receives) > 1:     # issue 29: one receive side per shaped interface
        click.echo("receive:   " + ", ".join(
            f"{printable(n)}: {printable(ifb or '-')} {printable(state)}"
            + (f" ({printable(problem)})" if problem else "")
            for n, ifb, state, problem in a.receives))
    elif a.receive:             # issue 17: the receive side (an ifb fed from the ingress)
        ifb, state, problem = a.receive
        click.echo(f"receive:   {printable(ifb or '-')} {printable(state)}"
                   + (f" ({printable(problem)})" if problem else ""))
    if len(a.interfaces) > 1 or a.unmanaged:    # issue 29: several interfaces
        click.echo("interfaces: " + ", ".join(
            f"{printable(n)} {printable(b or '-')} {printable(st)}" for n, b, st in a.interfaces))
        click.echo(f"unmanaged: {a.unmanaged} flows a rule shapes leave by an interface not "
                   "shaped (status --all says which)")
    click.echo(f"flows:     {a.shaped_flows} shaped of {a.live_flows} live; "
               f"source: {printable(a.flow_source)}")
    if a.spares:                                # issue 26: classes waiting for new flows
        click.echo("spares:    " + ", ".join(
            f"{printable(n)} {sp} classes" + (f" (ready_classes {ready})" if ready else "")
            for n, sp, ready in a.spares))
    fb = a.first_byte
    if fb:
        click.echo("first byte: ready " + (", ".join(
            f"{printable(rule)} {n}" for rule, n in fb.ready) or "none")
            + f"; claimed {fb.count('claimed')}"
            + (f" (guarded {fb.count('guarded')})" if fb.count("guarded") else "")
            + f", stopgap {fb.count('stopgap')} (lifted "
              f"{fb.count('lifted')}), missed {fb.count('missed')}, refilled "
              f"{fb.count('refilled')}, returned unclaimed "
              f"{fb.count('returned') + fb.count('released')}, pool exhausted "
              f"{fb.count('exhausted')}")
        if fb.note:
            click.echo(f"            {printable(fb.note)}")
    if a.stages:
        click.echo("stages:    " + ", ".join(
            f"{printable(s.name)} {printable(s.state)}"
            + (f" ({s.failures} failures, last: {printable(s.last_error)})" if s.failures else "")
            for s in a.stages))
    unshaped = ()
    if all_flows:
        try:
            unshaped = parse_unshaped(st)
        except ValueError as e:
            _fail(f"{socket_path}: {e}")
    _shaped_table(a)
    if unshaped:
        click.echo(f"not shaped: {len(unshaped)}")
        _table([("PID", "PROCESS", "PROTO", "DIRECTION", "LOCAL", "REMOTE", "WHY")] + [
            (str(pid), printable(proc or "?"), key.protocol.value, printable(d or "?"),
             key.local_endpoint, key.remote_endpoint, printable(why))
            for key, pid, proc, d, why in unshaped])
    elif all_flows:
        click.echo("not shaped: none")


def _table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _shaped_table(a) -> None:
    if not a.flows:
        return
    several = len(a.interfaces) > 1          # issue 29: the interface column
    rows = [("RULE", "PID", "PROCESS", "PROTO", "LOCAL", "REMOTE") + (("IF",) if several else ())
            + ("CLASS", "RATE", "SENT", "SOURCE")]
    for f in a.flows:
        rule = f.rule + (" (receive)" if f.side is Side.RECEIVE else "")
        rows.append((printable(rule), str(f.pid), printable(f.process), f.key.protocol.value,
                     f.key.local_endpoint, f.key.remote_endpoint)
                    + ((printable(f.interface),) if several else ())
                    + (printable(f.classid), format_bit_rate(f.rate_bit), format_bytes(f.bytes),
                       printable(f.source)))
    _table(rows)


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
def reload(socket_path):
    """Ask the running daemon to reload its rules file."""
    try:
        r = parse_reload(call(socket_path, {"cmd": "reload"}))
    except (FlowpacerError, ValueError) as e:
        _fail(str(e))
    if not r.ok:
        for e in r.errors:
            click.echo(printable(e), err=True)
        sys.exit(2)
    click.echo(f"reloaded: {r.changed} flows re-rated, {r.added} added, {r.removed} removed")


def _side(text: str, what: str):
    """An --local/--remote value -> (address or None, port or None): ADDR, ADDR:PORT,
    [V6ADDR]:PORT, a bare IPv6 address, or :PORT."""
    import ipaddress
    t = text.strip()
    host, port = t, None
    if t.startswith("["):
        host, sep, rest = t[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise click.BadParameter(f"{text!r}: write [IPV6]:PORT", param_hint=what)
        port = rest[1:] or None
    elif t.count(":") == 1:
        host, port = t.split(":")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise click.BadParameter(f"{text!r}: {port!r} is not a port (1..65535)", param_hint=what)
    addr = None
    if host:
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            hint = " (an IPv6 address with a port is written [IPV6]:PORT)" \
                if t.count(":") > 1 else ""
            raise click.BadParameter(f"{text!r}: {host!r} is not an IP address{hint}",
                                     param_hint=what) from None
    return addr, int(port) if port is not None else None


def _uid(text: str) -> int:
    import pwd
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except (KeyError, ValueError, OverflowError):
        raise click.BadParameter(f"unknown user {text!r}", param_hint="--user") from None


def _described_flow(process, exe, user, direction, local, remote, protocol):
    """The flow an offline explain describes, and the fields it leaves unknown (they are given
    values no rule field can match, and a rule failing only on them is "undecided")."""
    import ipaddress
    from flowpacer.model import Direction, Flow, FlowKey, ProcessInfo, Protocol
    unknown = set()
    (la, lp), (ra, rp) = local, remote
    if la is not None and ra is not None:
        la, ra = FlowKey.wire_address(la), FlowKey.wire_address(ra)
        if la.version != ra.version:
            raise click.UsageError("--local and --remote are of different address families")
    v6 = (la or ra) is not None and FlowKey.wire_address(la or ra).version == 6
    zero = ipaddress.ip_address("::" if v6 else "0.0.0.0")
    for name, value in (("local", la), ("local_port", lp), ("remote_port", rp), ("remote", ra),
                        ("process", process), ("exe", exe), ("user", user),
                        ("direction", direction)):
        if value is None:
            unknown.add(name)
    key = FlowKey(FlowKey.wire_address(la) if la is not None else zero, lp or 0,
                  FlowKey.wire_address(ra) if ra is not None else zero, rp or 0,
                  Protocol(protocol))
    comm = process.encode("utf-8", "surrogateescape")[:15].decode("utf-8", "replace") \
        if process is not None else ""
    proc = ProcessInfo(pid=0, comm=comm, exe=exe or "", uid=_uid(user) if user is not None else -1)
    return Flow(key, Direction(direction) if direction else Direction.ANY, proc), unknown


def _shown_endpoint(text: str, no_addr: bool, no_port: bool) -> str:
    """An endpoint of a described flow, '*' for what was not given."""
    host, _, port = text.rpartition(":")
    return f"{'*' if no_addr else host}:{'*' if no_port else port}"


def _print_explained(e, offline: bool) -> None:
    from flowpacer.units import format_bit_rate as rate
    who = []
    if e.process or not offline:
        who.append(f"process {printable(e.process or '?')}"
                   + ("" if offline else f" (pid {e.pid}, uid {e.uid})"))
    if e.exe:
        who.append(f"exe {printable(e.exe)}")
    if offline and e.uid >= 0:
        who.append(f"uid {e.uid}")
    local, remote = (_shown_endpoint(e.local, "local" in e.unknown, "local_port" in e.unknown),
                     _shown_endpoint(e.remote, "remote" in e.unknown,
                                     "remote_port" in e.unknown))
    click.echo(f"flow: {e.protocol} {local} <-> {remote}, "
               f"{e.direction if e.direction in ('inbound', 'outbound') else 'direction ?'}"
               + (", " + ", ".join(who) if who else ""))
    if e.unknown:
        click.echo(f"  not given: {', '.join(u if u != 'local' else 'local address' for u in e.unknown)}"
                   " (a rule that tests them may or may not match)")
    for p in e.passed:
        if p.undecided:
            click.echo(f"  {printable(p.rule)} (line {p.line}): may match, depends on "
                       f"{', '.join(p.fails)} (not given)")
        else:
            known = [f for f in p.fails if f not in e.unknown]
            rest = [f for f in p.fails if f in e.unknown]
            click.echo(f"  {printable(p.rule)} (line {p.line}): no match on {', '.join(known)}"
                       + (f" (not given: {', '.join(rest)})" if rest else ""))
    if e.rule is None:
        click.echo("rule: none matches: the flow is not shaped")
    else:
        what = (f"rate {rate(e.rate_bit)} per flow" if e.sends else
                "receive only: what the flow is sent is not shaped")
        if e.receives:
            what += ", receive_rate set (uploads shaped)"
        cond = (" if the rules that may match above do not"
                if any(p.undecided for p in e.passed) else "")
        click.echo(f"rule: {printable(e.rule)} (line {e.rule_line}) wins{cond}: {what}")
    click.echo(f"first byte: {'yes' if e.first_byte else 'no'}: {printable(e.first_byte_why)}")
    for c in e.classes:
        click.echo(f"class: {printable(c.classid)} ({c.side.value}) rule {printable(c.rule)}, "
                   f"rate {rate(c.rate_bit)}, ceil {rate(c.ceil_bit)}, sent "
                   f"{format_bytes(c.bytes)} in {c.packets} packets, {c.drops} dropped")
    if e.unshaped:
        click.echo(f"class: none: {printable(e.unshaped)}")


@main.command()
@click.option("--rules", "rules_path", type=click.Path(dir_okay=False),
              help="explain a described flow offline against this rules file (default: ask "
                   "the running daemon about its live flows)")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--local", default=None, metavar="ADDR[:PORT]",
              help="the flow's local address and/or port ([IPV6]:PORT, :PORT)")
@click.option("--remote", default=None, metavar="ADDR[:PORT]",
              help="the flow's remote address and/or port")
@click.option("--protocol", type=click.Choice(["tcp", "udp"]), default=None,
              help="the flow's protocol (a described flow: tcp unless given)")
@click.option("--process", default=None, help="a described flow's process name (comm)")
@click.option("--exe", default=None, help="a described flow's executable path")
@click.option("--user", default=None, help="a described flow's user (name or uid)")
@click.option("--direction", type=click.Choice(["inbound", "outbound"]), default=None,
              help="a described flow's direction (inbound: the process accepted it)")
@click.option("--json", "as_json", is_flag=True)
def explain(rules_path, socket_path, local, remote, protocol, process, exe, user, direction,
            as_json):
    """Which rule a flow gets and why: the rules before it that do not match (and the fields
    that differ), whether the kernel shapes it from its first byte, and for a live flow its
    class, rate and counters.

    A live flow (the daemon's, by addresses and ports): flowpacer explain --remote
    192.0.2.7:51000. A described one, offline from a rules file: flowpacer explain --rules
    /etc/flowpacer/rules.yaml --process nginx --user www-data --direction inbound --local
    :443"""
    loc = _side(local, "--local") if local else (None, None)
    rem = _side(remote, "--remote") if remote else (None, None)
    described = any(v is not None for v in (process, exe, user, direction))
    if rules_path is None and described:
        rules_path = "/etc/flowpacer/rules.yaml"
    if rules_path is not None:
        from flowpacer.policy import engine, handshake, rules as loader
        from flowpacer.surfaces import view
        try:
            rs = loader.load(rules_path)
        except RulesError as e:
            _rules_fail(e)
        flow, unknown = _described_flow(process, exe, user, direction, loc, rem,
                                        protocol or "tcp")
        answer = {"flows": [view.explain_json(engine.explain(rs.rules, flow, unknown),
                                              handshake.first_byte(rs, flow, unknown=unknown))]}
    else:
        req = {"cmd": "explain"}
        for k, v in (("local_addr", loc[0]), ("local_port", loc[1]), ("remote_addr", rem[0]),
                     ("remote_port", rem[1]), ("protocol", protocol)):
            if v is not None:
                req[k] = str(v) if k.endswith("addr") else v
        if len(req) == 1:
            raise click.UsageError("give the live flow's --local and/or --remote (ADDR[:PORT]), "
                                   "or describe a flow (--process, --user, ...) with --rules")
        try:
            answer = call(socket_path, req)
        except FlowpacerError as e:
            _fail(str(e))
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    try:
        flows = parse_explain(answer)
    except ValueError as e:
        _fail(f"{socket_path}: {e}")
    if not flows:
        _fail("no live flow has these addresses and ports")
    for i, e in enumerate(flows):
        if i:
            click.echo("")
        _print_explained(e, rules_path is not None)
    more = answer.get("matched", len(flows)) if isinstance(answer.get("matched"), int) else 0
    if more > len(flows):
        click.echo(f"... and {more - len(flows)} more flows (narrow the addresses and ports)")


@main.group()
def rules():
    """Rules files."""


@rules.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True,
              help="warnings are errors: tc's byte units (kbps, mbps) are refused, and any "
                   "other warning (a shadowed rule, an ignored field, an owner or mode the "
                   "daemon refuses) makes the exit status 2")
def rules_check(file, strict):
    """Validate FILE (no root needed) and print each rule with its rate in bit/s; warn about
    rules that can never match, fields the rule's protocol ignores, rates in byte units and an
    owner or mode the daemon would refuse."""
    from flowpacer.policy import rules as loader
    try:
        rs = loader.load(file, strict_units=strict)
    except RulesError as e:
        _rules_fail(e)
    for line in loader.describe(rs):
        click.echo(printable(line))
    refused = loader.access_problem(file)       # the daemon's own check, at start and reload
    if refused:
        click.echo(printable(f"{refused}: warning: the daemon refuses this file"), err=True)
    if strict and (rs.warnings or refused):
        sys.exit(2)


@rules.command("edit")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
def rules_edit(file, socket_path):
    """Edit FILE (default: the running daemon's rules file, else /etc/flowpacer/rules.yaml)
    in $VISUAL/$EDITOR, validate it, replace it atomically and reload the daemon."""
    from flowpacer.surfaces.edit import edit
    sys.exit(edit(file, socket_path))


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.1, 60),
              help="refresh period, seconds")
def top(socket_path, interval):
    """Live view of the shaped flows, sorted by actual rate (q quits)."""
    from flowpacer.surfaces.top import run_top
    sys.exit(run_top(socket_path, interval))


@main.command()
@click.option("--interface", help="the interface to clean")
@click.option("--all", "everywhere", is_flag=True,
              help="every interface of this network namespace")
@click.option("--after-stop", "unit", metavar="UNIT",
              help="as the systemd unit UNIT's ExecStopPost=: do nothing when UNIT is being "
                   "restarted (the next process adopts the classes)")
def cleanup(interface, everywhere, unit):
    """Remove everything flowpacer made on INTERFACE, or on every interface (no daemon needed)."""
    if bool(interface) == bool(everywhere):
        _fail("give --interface IF or --all")
    if unit:
        from flowpacer.surfaces.afterstop import after_stop
        d = after_stop(unit)
        if not d.remove:
            click.echo(f"{unit}: flowpacer's classes left in place: {d.why}")
            return
    from flowpacer.kernel.backend.ingress import cleanup as receive_cleanup, cleanup_all
    from flowpacer.kernel.backend.tc import cleanup as do_cleanup
    try:
        if everywhere:
            done = cleanup_all()
            click.echo("\n".join(done) if done else "nothing of flowpacer found")
            return
        removed = do_cleanup(interface)
        rx = receive_cleanup(interface)       # the receive side's ifb and redirect (issue 17)
    except (FlowpacerError, OSError) as e:
        _fail(str(e))
    what = [w for w, done in (("flowpacer qdisc", removed), ("receive side (ifb)", rx)) if done]
    click.echo(f"{interface}: {' and '.join(what) + ' removed' if what else 'nothing of flowpacer found'}")


if __name__ == "__main__":
    main()
