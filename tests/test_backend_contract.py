"""The backend contract (flowpacer/kernel/backend/contract.py): every backend and codec has every
member the daemon uses, and the one contract suite (harness/backend_contract.py) passes against
FakeBackend (pure) and htb on the host (kernel). psp runs the same suite in the VM
(tests/guest/test_backend_contract.py)."""
import pytest

from flowpacer.kernel.backend import registry
from flowpacer.kernel.backend.contract import Backend, Codec, Pools, members, missing_members
from flowpacer.kernel.backend.htb import HtbCodec
from flowpacer.kernel.backend.psp import PspCodec
from flowpacer.model import BackendKind, Side
from harness import backend_contract as bc
from harness.fakes import FakeBackend, FakeFactory


class _Empty:
    pass


def test_the_protocols_name_what_the_daemon_calls():
    names = set(members(Backend))
    assert {"apply", "installed", "shape_of", "setup", "teardown", "check", "audit", "forget",
            "resync", "close", "flows_snapshot", "group_views", "class_stats", "stats",
            "open_stats_channel", "capabilities", "kind", "name", "interface",
            "link_rate_bps", "link_rate_source", "spare_count", "spare_handles"} == names
    assert {"makes_default_class", "supports_groups", "kernel_shares", "has_link_class",
            "qdisc_kind", "kind"} <= set(members(Codec))
    assert "pool" in members(Pools) and "apply" in members(Pools)
    # the check fails on a missing member, attributes included
    assert missing_members(_Empty(), Backend) == sorted(names)
    half = FakeBackend()
    del half.capabilities
    assert missing_members(half, Backend) == ["capabilities"]


@pytest.mark.parametrize("codec", [HtbCodec(), PspCodec()], ids=["htb", "psp"])
def test_the_codecs_declare_their_attributes(codec):
    assert missing_members(codec, Codec) == [] and isinstance(codec, Codec)
    for attr in ("has_link_class", "makes_default_class", "supports_groups", "kernel_shares"):
        assert isinstance(getattr(codec, attr), bool), attr
    assert codec.kind is registry.spec(codec.kind).kind
    assert type(registry.spec(codec.kind).codec()) is type(codec)


def test_the_tc_backends_keep_the_protocol_and_declare_capabilities():
    from flowpacer.kernel.backend.ingress import IngressBackend
    from flowpacer.kernel.backend.tc import TcBackend
    for b in (TcBackend(HtbCodec(), "lo", 1000), TcBackend(PspCodec(), "lo", 1000),
              IngressBackend(PspCodec(), "lo", 1000)):
        try:
            assert missing_members(b, Backend) == [] and isinstance(b, Backend)
            assert b.capabilities.has_classes and b.capabilities.groups
            assert b.capabilities.kernel_shares is b.codec.kernel_shares
            assert b.capabilities.pools is (b.capabilities.side is Side.SEND)
            # the flow class ids, f1f0:10..f1f0:bfff (the pools' ids above them)
            assert b.capabilities.class_ids == 0xBFFF - 0x10 + 1
            if b.capabilities.pools:
                assert missing_members(b, Pools) == []
        finally:
            b.close()


def test_the_fakes_keep_the_protocol():
    fac = FakeFactory()
    b, _why = fac.make(BackendKind.HTB, "fake0", None)
    rx = fac.make_receive(b, "fake0", None)
    for x in (b, rx):
        assert missing_members(x, Backend) == [] and isinstance(x, Backend)
        assert not x.capabilities.groups
    # the send side declares first-byte pools and keeps their protocol; the receive side has none
    assert b.capabilities.pools and missing_members(b, Pools) == [] and isinstance(b, Pools)
    assert not rx.capabilities.pools
    assert rx.capabilities.side is Side.RECEIVE


def test_every_backend_kind_is_registered_once():
    assert set(registry.kinds()) == set(BackendKind) - {BackendKind.AUTO}
    assert registry.auto_order()[0].kind is BackendKind.PSP      # auto prefers psp
    assert registry.choices_text() == "auto, psp or htb"
    # issue 26: htb keeps closed flows' classes as spares, psp deletes them
    assert [s.kind for s in registry.auto_order() if s.keeps_spares] == [BackendKind.HTB]


def test_the_factory_keeps_spares_as_the_kind_declares(monkeypatch):
    """The supervisor's factory reads ``keeps_spares`` from the registry, never the kind's name:
    turning the declaration round turns the backends' spares round."""
    import dataclasses
    from flowpacer.daemon.supervisor import TcBackendFactory
    from flowpacer.kernel.backend.handles import SPARE_MAX
    monkeypatch.setattr(TcBackendFactory, "_ready", staticmethod(lambda b: b))   # no root qdisc
    fac = TcBackendFactory()

    def spare_max():
        out = {}
        for codec in (HtbCodec(), PspCodec()):
            b = fac._set_up(codec, "lo", 1000)
            out[codec.kind] = b.spare_max
            b.close()
        return out
    assert spare_max() == {BackendKind.HTB: SPARE_MAX, BackendKind.PSP: 0}
    flipped = {k: dataclasses.replace(s, keeps_spares=not s.keeps_spares)
               for k, s in registry.SPECS.items()}
    monkeypatch.setattr(registry, "SPECS", flipped)
    assert spare_max() == {BackendKind.HTB: 0, BackendKind.PSP: SPARE_MAX}


# ------------------------------------------------------------------------- the suite

# htb keeps closed flows' classes as spares (issue 26) once flows and spares number 256, at most
# 16 384: the suite runs once as a small setup has it (none), once with spares from the third
# class on and at most 2 (kept, reused, capped, adopted in the cases' few flows)
SPARES = {"": {}, "spares": {"spare_max": 2, "spare_from": 3}}


@pytest.mark.parametrize("spares", SPARES, ids=["plain", "spares"])
@pytest.mark.parametrize("case", bc.CASES, ids=bc.case_ids())
def test_contract_fake(case, spares):
    bed = bc.FakeBed(spare_max=SPARES[spares].get("spare_max", 0))
    try:
        case(bed)
    finally:
        bed.close()


@pytest.mark.kernel
@pytest.mark.parametrize("spares", SPARES, ids=["plain", "spares"])
@pytest.mark.parametrize("case", bc.CASES, ids=bc.case_ids())
def test_contract_htb(case, spares, testbed):
    bed = bc.TcBed(testbed, HtbCodec, "htb", **SPARES[spares])
    try:
        case(bed)
    finally:
        bed.close()
