"""Flow sources: the eBPF tracer (tracer.py, bpf/), sock_diag snapshots (sockdiag.py) and the
first-byte handshake programs (firstbyte.py, cgroupbpf.py). They report flows; they decide
nothing and write nothing to tc.
"""
