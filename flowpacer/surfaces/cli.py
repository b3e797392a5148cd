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
from flowpacer.surfaces.view import parse_reload, parse_status


def _setup_logging(verbose: int) -> None:
    under_systemd = bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"))
    fmt = "%(levelname)s %(name)s: %(message)s" if under_systemd else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose or under_systemd else logging.INFO
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)
    if verbose < 2:
        logging.getLogger("pyroute2").setLevel(logging.WARNING)


def _fail(msg: str, code: int = 1):
    click.echo(f"flowpacer: {printable(msg)}", err=True)
    sys.exit(code)


def _rules_fail(e: RulesError):
    for p in e.problems:
        click.echo(printable(str(p)), err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--metrics-addresses", default="full", show_default=True,
              type=click.Choice(["full", "prefix", "none"]),
              help="per-flow address labels: as they are, their /24 or /48 network, or none "
                   "(ports dropped too)")
@click.option("--web.config.file", "web_config_file", type=click.Path(dir_okay=False),
              help="TLS and basic auth of the metrics endpoint (Prometheus exporter web "
                   "configuration file)")
@click.option("--keep-on-exit", is_flag=True, envvar="FLOWPACER_KEEP_ON_EXIT",
              help="on SIGTERM leave the qdisc, classes and filters for the next start to adopt "
                   "(a restart without a gap; the systemd unit removes them on stop)")
@click.option("-v", "--verbose", count=True)
def run(rules_path, interface, backend, socket_path, take_over, rescan, no_tracer, metrics_listen,
        no_metrics, metrics_max_flows, metrics_addresses, web_config_file, keep_on_exit, verbose):
    """Run the daemon: shape each matched flow until stopped (SIGTERM removes everything it
    made, unless --keep-on-exit)."""
    _setup_logging(verbose)
    if os.geteuid() != 0:
        _fail("run needs root (CAP_NET_ADMIN for tc, CAP_BPF/CAP_SYS_ADMIN for the tracer)")
    from flowpacer.daemon.app import Daemon, Options
    d = Daemon(Options(rules_path, interface, BackendKind(backend) if backend else None,
                       socket_path, take_over, rescan, not no_tracer,
                       None if no_metrics else metrics_listen, metrics_max_flows,
                       metrics_addresses, web_config_file,
                       # benchmarks' "before" figures: flows get their class after the handshake
                       first_byte=not os.environ.get("FLOWPACER_NO_FIRST_BYTE"),
                       keep_on_exit=keep_on_exit))
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


@main.command()
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def status(socket_path, as_json):
    """Show the backend and every shaped flow of the running daemon."""
    try:
        st = call(socket_path, {"cmd": "status"})
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
    click.echo(f"interface: {printable(a.interface)}, link {format_bit_rate(a.link_rate_bit)}")
    if a.backend_state != "ok":
        click.echo(f"state:     {printable(a.backend_state)}"
                   + (f" (cannot rebuild, {a.rebuild_failures} attempts failed: "
                      f"{printable(a.backend_problem)})" if a.backend_problem else ""))
    if a.receive:               # issue 17: the receive side (an ifb fed from the ingress)
        ifb, state, problem = a.receive
        click.echo(f"receive:   {printable(ifb or '-')} {printable(state)}"
                   + (f" ({printable(problem)})" if problem else ""))
    click.echo(f"flows:     {a.shaped_flows} shaped of {a.live_flows} live; "
               f"source: {printable(a.flow_source)}")
    fb = a.first_byte
    if fb:
        click.echo("first byte: ready " + (", ".join(
            f"{printable(rule)} {n}" for rule, n in fb.ready) or "none")
            + f"; claimed {fb.count('claimed')}, refilled {fb.count('refilled')}, returned "
              f"unclaimed {fb.count('returned') + fb.count('released')}, pool exhausted "
              f"{fb.count('exhausted')}")
    if a.stages:
        click.echo("stages:    " + ", ".join(
            f"{printable(s.name)} {printable(s.state)}"
            + (f" ({s.failures} failures, last: {printable(s.last_error)})" if s.failures else "")
            for s in a.stages))
    if not a.flows:
        return
    rows = [("RULE", "PID", "PROCESS", "PROTO", "LOCAL", "REMOTE", "CLASS", "RATE", "SENT",
             "SOURCE")]
    for f in a.flows:
        rule = f.rule + (" (receive)" if f.side is Side.RECEIVE else "")
        rows.append((printable(rule), str(f.pid), printable(f.process), f.key.protocol.value,
                     f.key.local_endpoint, f.key.remote_endpoint, printable(f.classid),
                     format_bit_rate(f.rate_bit), format_bytes(f.bytes), printable(f.source)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


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


@main.group()
def rules():
    """Rules files."""


@rules.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def rules_check(file):
    """Validate FILE (no root needed) and print each rule with its rate in bit/s."""
    from flowpacer.policy import rules as loader
    try:
        rs = loader.load(file)
    except RulesError as e:
        _rules_fail(e)
    for line in loader.describe(rs):
        click.echo(printable(line))


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
