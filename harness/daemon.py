"""The daemon runner: ``flowpacer run`` in a testbed's server namespace, for tests and benchmarks.

    d = Daemon(tb, tmp_path, RULES, "--rescan", "0.2").start()     # waits until it answers
    d.flows(); d.status(); d.call({"cmd": "reload"})
    assert d.stop() == 0                                           # SIGTERM, its exit status

``Daemon`` is ``harness.testbed.Daemon`` (``make demo`` runs the daemon with it too); here
with the rules file most tests use and the checks of a daemon's health after a test.
"""
from __future__ import annotations

from typing import Iterable, List

from harness.testbed import FLOWPACER, Daemon, DaemonExited  # noqa: F401 (re-exported)

from .capture import kernel_objects, qdisc_kind  # noqa: F401 (re-exported: what a daemon left)

# The three-rule file most daemon tests use: two inbound rules of the server fp-test-srv on
# ports 9101 (10 Mbit/s) and 9102 (100 Mbit/s), one outbound rule of the client fp-test-cli.
RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: slow
        match: {process: fp-test-srv, direction: inbound, local_port: 9101}
        rate: 10mbit
      - name: fast
        match: {process: fp-test-srv, direction: inbound, local_port: 9102}
        rate: 100mbit
      - name: out
        match: {process: fp-test-cli, direction: outbound, remote_port: 9201}
        rate: 20mbit
"""

def healthy(status: dict) -> List[str]:
    """What is wrong with a status answer's stage report ([] when every stage runs).

    The status answer carries ``stages`` and ``healthy`` since the daemon's stages are
    supervised (issue 12); a stage turned off by an option is "disabled", which is fine; a
    missing key is reported as a problem too."""
    bad = []
    if "stages" not in status or "healthy" not in status:
        return ["the status answer has no 'stages'/'healthy' keys"]
    for st in status["stages"]:
        if st.get("state") not in ("running", "disabled"):
            bad.append(f"stage {st.get('name')} is {st.get('state')} (failures "
                       f"{st.get('failures')}, last error {st.get('last_error')!r})")
    if not status["healthy"] and not bad:
        bad.append("status says healthy=false")
    return bad


def tracebacks(log_text: str) -> Iterable[str]:
    """The tracebacks in a daemon log, each with the lines around it."""
    lines = log_text.splitlines()
    for i, ln in enumerate(lines):
        if "Traceback" in ln:
            yield "\n".join(lines[max(0, i - 2):i + 25])
