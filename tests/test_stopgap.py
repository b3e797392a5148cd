"""The stopgap's rates and generations (issue 26), pure: what FirstByte writes into fb_rate for
the program. The kernel side (the limit set at the handshake, lifted at an ACK after a reload)
is tests/test_flashcrowd.py's."""
import textwrap

from flowpacer.policy import handshake, rules as rules_loader
from flowpacer.sources import firstbyte

RULES = """
    interface: eth0
    backend: htb
    link_rate: 10gbit
    rules:
      - name: a
        match: {process: nginx, direction: inbound}
        rate: 8mbit
      - name: b
        match: {local_port: 7400}
        rate: 2mbit
        ceil: 4mbit
      - name: c
        match: {exe: ["/usr/bin/*"]}
        rate: 1mbit
      - name: d
        match: {local_port: 7500}
        rate: 3mbit
"""


def _rows(fb, tmp_path, text):
    p = tmp_path / "rules.yaml"
    p.write_text(textwrap.dedent(text))
    rs = rules_loader.load(str(p))
    return fb._stopgaps(rs, handshake.compile_rules(rs))


def test_rates_are_the_kernel_rules_class_rates(tmp_path):
    rows = _rows(firstbyte.FirstByte(), tmp_path, RULES)
    assert len(rows) == firstbyte.MAX_RULES
    rates = [r for r, _g in rows]
    # bytes/s as the class counts them; the ceiling where there is one; none for a rule the
    # kernel does not decide (c: an exe pattern) or for indexes without a rule
    assert rates[:4] == [1_000_000, 500_000, 0, 375_000]
    assert not any(rates[4:])


def test_generation_changes_from_the_first_changed_rule_on(tmp_path):
    fb = firstbyte.FirstByte()
    g1 = [g for _r, g in _rows(fb, tmp_path, RULES)]
    assert len(set(g1)) == len(g1)
    # the same rules (a rebuild, a reload that changed nothing): nothing lifted
    assert [g for _r, g in _rows(fb, tmp_path, RULES)] == g1
    # b's rate raised: a and the indexes past the rules keep theirs, b, c and d change (a flow
    # of d's may now be b's)
    g2 = [g for _r, g in _rows(fb, tmp_path, RULES.replace("rate: 2mbit", "rate: 6mbit")
                               .replace("ceil: 4mbit", "ceil: 8mbit"))]
    assert g2[0] == g1[0] and g2[4:] == g1[4:]
    assert all(g2[i] != g1[i] for i in (1, 2, 3))


def test_no_stopgap_knob(tmp_path, monkeypatch):
    monkeypatch.setenv(firstbyte.NO_STOPGAP_ENV, "1")
    assert not any(r for r, _g in _rows(firstbyte.FirstByte(), tmp_path, RULES))
