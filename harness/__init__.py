"""The one test and benchmark harness of flowpacer (tests/ and bench/ both import it; it imports
neither). Run from the repository root (``python -m pytest``, ``python -m bench.run``, and the
same inside the test VM), so it needs no installation.

- ``harness.testbed``: the network-namespace testbed (``Testbed``, ``wait_for``, ``in_netns``);
- ``harness.daemon``: the daemon runner (``Daemon``: start, ready, status, stop);
- ``harness.servers``: real servers (nginx, iperf3, rsync) and flowpacer's own;
- ``harness.traffic``: clients (blaster fetch, iperf3, ab, h2load, curl, socket clients), rates
  measured at the receiver;
- ``harness.capture``: what the kernel holds (classes, filters, connections);
- ``harness.crowd``: flash crowds (h2load clients at once, per-request times, first-byte counts);
- ``harness.fakes``: in-memory backend and flow sources for in-process daemon tests;
- ``harness.scenarios``: the reliability scenarios (crash/restart, churn soak);
- ``harness.terminal``: a private tmux server for full-screen commands;
- ``harness.pacing``: pacing measurements in the VM (qdisc set-ups, iperf3 and pktgen runs,
  packet captures, gap statistics);
- ``harness.psplib``: the psp module in the VM (loading it, rtnetlink requests with extack);
- ``harness.bondbed``, ``harness.vrfbed``: testbeds for the VM whose server side is a bond with
  a VLAN on it, or has a second interface in a VRF (issue 29);
- ``harness.vm``: the qemu test VM runner.
"""
