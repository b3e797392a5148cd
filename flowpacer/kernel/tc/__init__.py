"""tc encodings we own, one module per kind (pyroute2 plugin style).

``register()`` plugs them into pyroute2's tcmsg plugin table so that pyroute2 dumps decode our
objects (u32 hash tables and keys, psp options). The daemon's hot path packs requests itself
(``nl.py``) and does not need the registration.
"""
from __future__ import annotations

import importlib


def register() -> None:
    from pyroute2.netlink.rtnl import tcmsg as _tcmsg
    from flowpacer.kernel.tc import u32
    _tcmsg.plugins["u32"] = u32
    try:
        psp = importlib.import_module(".psp", __name__)
    except ImportError:
        return
    _tcmsg.plugins["psp"] = psp
