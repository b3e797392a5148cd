"""The kernel side: backends (backend/: the only writers of tc state, applying plans of Ops), the
netlink encodings (tc/: one module per tc kind) and the psp qdisc module's source (kmod/,
shipped by the sch-psp-dkms package, not in the Python package).
"""
