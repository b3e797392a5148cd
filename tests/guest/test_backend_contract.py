"""The backend contract suite (harness/backend_contract.py) against psp, in the VM: the same
cases as FakeBackend and htb on the host (tests/test_backend_contract.py)."""
import pytest

from flowpacer.kernel.backend.psp import PspCodec
from harness import backend_contract as bc


@pytest.mark.parametrize("case", bc.CASES, ids=bc.case_ids())
def test_contract_psp(case, tb):
    bed = bc.TcBed(tb, PspCodec, "psp")
    try:
        case(bed)
    finally:
        bed.close()
