"""The backend kinds, registered in this one place.

Each ``BackendSpec`` says how to make its codec, which kernel module it needs (None: every kernel
has it), where it stands in ``auto``'s order of preference and whether its backend keeps closed
flows' classes as spares. ``choose``/``fallback``
(backend/__init__.py), the supervisor's factory, the cli and the rules' documentation read it
from here; adding a kind is its codec module, its ``BackendKind`` value and one entry below.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional

from flowpacer.model import BackendKind


@dataclass(frozen=True)
class BackendSpec:
    kind: BackendKind
    codec_path: str                  # "module:Class" of its Codec, imported when first made
    module: Optional[str]            # kernel module it needs; None: in every kernel
    auto_rank: int                   # auto tries the kinds by rank, lowest first
    # a closed flow's class is kept (no filter) and changed for the next new flow, up to
    # handles.SPARE_MAX (issue 26: making and deleting classes is what a burst costs the kernel);
    # False: a closed flow's class is deleted
    keeps_spares: bool

    def codec(self):
        mod, cls = self.codec_path.split(":")
        return getattr(importlib.import_module(mod, __package__), cls)()


SPECS: Dict[BackendKind, BackendSpec] = {s.kind: s for s in (
    BackendSpec(BackendKind.PSP, ".psp:PspCodec", "sch_psp", 0, keeps_spares=False),
    BackendSpec(BackendKind.HTB, ".htb:HtbCodec", None, 1, keeps_spares=True),
)}


def spec(kind) -> BackendSpec:
    """The spec of a kind (a ``BackendKind`` or its name)."""
    return SPECS[BackendKind(kind)]


def auto_order() -> List[BackendSpec]:
    return sorted(SPECS.values(), key=lambda s: s.auto_rank)


def kinds() -> List[BackendKind]:
    """The concrete kinds (not ``auto``)."""
    return [s.kind for s in auto_order()]


def choices_text() -> str:
    """"auto, psp or htb": what a rules file may say."""
    names = [BackendKind.AUTO.value] + [k.value for k in kinds()]
    return ", ".join(names[:-1]) + " or " + names[-1]


def doc_text() -> str:
    """The rules' documentation of ``backend``."""
    specs = auto_order()
    each = [f"{s.kind.value} (the {s.module} module)" if s.module else s.kind.value
            for s in specs]
    order = ", else ".join([f"{specs[0].kind.value} when it loads"]
                           + [s.kind.value for s in specs[1:]])
    return f"{', '.join(each)}, or auto ({order})"
