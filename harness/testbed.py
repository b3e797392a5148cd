"""The testbed: two network namespaces joined by a veth pair (``flowpacer.testbed.Testbed``,
which ships in the package because ``make demo`` uses it; this is the one Testbed class).

    with Testbed() as tb:          # server 10.77.n.1 fd77:n::1  <->  client 10.77.n.2 fd77:n::2
        tb.popen(tb.server_ns, [...]); tb.run(tb.client_ns, [...]); tb.wait_listening(8080)

The pacing tools of the VM (``harness/pacing.py``) use the same class through its sender/
receiver names: ``sender_ns``/``sender_dev``/``sender_addr`` are the server's side.
"""
from flowpacer.testbed import (PY, Testbed, TestbedError, client_argv, in_netns, server_argv, sh,
                               wait_for)

__all__ = ["PY", "Testbed", "TestbedError", "client_argv", "in_netns", "server_argv", "sh",
           "wait_for"]
