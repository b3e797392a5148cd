"""A flash crowd on psp (issue 26 item 3, the psp VM suite's smaller scale of the host's htb
test, tests/test_flashcrowd.py): the whole daemon (tracer and first-byte programs, compiled in
the guest) shapes nginx's replies to two h2load processes started together, 100 clients over
IPv4 and 100 over IPv6, one 64 KiB reply each. The rule's pool holds 48 ready classes, so most
of the crowd finds it dry and is paced by the stopgap (the socket's SO_MAX_PACING_RATE) until
its psp class is in. At least 99.5 % of the replies take at least the time the rule's rate
allows (per request, from h2load's log), every flow the kernel decided is counted once (class,
stopgap or missed), every stage runs, and nothing is left after the stop. In virtual time: the
figures do not depend on the host's load."""
from __future__ import annotations

import pytest

from harness import bpfobjs, crowd
from harness.pacing import guest_timeout as gt
from harness.servers import Nginx
from harness.testbed import Daemon, wait_for

OBJECT = 64 << 10
RATE_BIT = 400_000                     # per flow: a paced 64 KiB reply takes >= ~1 s
RATE_BPS = RATE_BIT // 8
CLIENTS = 100                          # per address family
MIN_S = crowd.min_reply_s(OBJECT, RATE_BPS)            # psp: no burst
RULES = crowd.crowd_rules("psp", RATE_BIT, "1gbit")


def test_psp_flash_crowd_every_reply_is_paced_from_its_first_byte(tb, tmp_path):
    tb.set_gso(False)                  # "a packet" is one frame
    ng = Nginx(tb, tmp_path / "nginx", files={"obj": OBJECT}).start()
    (tmp_path / "d").mkdir()
    d = Daemon(tb, tmp_path / "d", RULES, "--rescan", "1", "--no-metrics")
    try:
        d.start(timeout=gt(600))       # bcc compiles the tracer and the first-byte programs
    except TimeoutError:
        d.stop(timeout=30)
        pytest.fail(f"the daemon did not answer; its log:\n{d.log_text()[-4000:]}")
    try:
        st = d.status()
        assert st["backend"] == "psp", st["backend_reason"]
        assert "rules shaped from the first byte: crowd" in st["flow_source"], st["flow_source"]
        objs = bpfobjs.held(d.pid())
        wait_for(lambda: any(p["ready"] > 0 for p in d.status()["first_byte"]["pools"]),
                 gt(60), 0.1, "the pool made")
        c0 = crowd.first_byte_counters(d)
        got = crowd.crowd(tb, (tb.server_v4, tb.server_v6), ng.port, "/obj", CLIENTS, tmp_path,
                          timeout_s=gt(150))
        ok, early = got.ok, got.early(MIN_S)
        delta = crowd.counted(d, c0, len(got.rows), timeout_s=gt(10)) if got.rows else {}
        print(f"psp flash crowd: {len(got.rows)} requests ({len(ok)} ok) in {got.took_s:.1f} s, "
              f"starts within {got.spread_ms:.0f} ms; {len(early)} replies under {MIN_S:.2f} s "
              f"(fastest {early[:5]}); counters {delta}")
        assert len(ok) == 2 * CLIENTS, (len(got.rows), len(ok), [o[-600:] for o in got.outputs])
        assert len(early) <= 0.005 * len(ok), \
            f"{len(early)} of {len(ok)} replies finished in under {MIN_S:.2f} s: heads left " \
            f"unpaced (fastest {early[:10]})"
        assert delta["claimed"] + delta["stopgap"] + delta["missed"] == len(ok), delta
        assert delta["claimed"] > 0 and delta["stopgap"] > 0, delta     # both ways were taken
        assert delta["missed"] <= 0.005 * len(ok), delta
        crowd.assert_nothing_left(tb, d, objs, spares_expected=False, settle_s=gt(60))
    finally:
        d.stop()
