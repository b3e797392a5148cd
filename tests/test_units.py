"""flowpacer.units: tc(8) rates -> bytes/s, checked against tc itself in a netns."""
from __future__ import annotations

import json
import re
import os
import secrets
import shutil
import subprocess
from fractions import Fraction

import pytest

from flowpacer import units
from flowpacer.units import format_bits, format_rate, parse_rate

# (text, exact bits per second): tc(8)'s RATES table, every unit, mixed case as tc allows
TABLE = [
    ("8", 8),
    ("8bit", 8),
    ("1kbit", 10**3),
    ("1KBIT", 10**3),
    ("8mbit", 8 * 10**6),
    ("1gbit", 10**9),
    ("2tbit", 2 * 10**12),
    ("1kibit", 2**10),
    ("3Mibit", 3 * 2**20),
    ("1gibit", 2**30),
    ("1tibit", 2**40),
    ("1bps", 8),
    ("1Bps", 8),
    ("125kbps", 125 * 8 * 10**3),
    ("1KBps", 8 * 10**3),
    ("2mbps", 2 * 8 * 10**6),
    ("1gbps", 8 * 10**9),
    ("1tbps", 8 * 10**12),
    ("1kibps", 8 * 2**10),
    ("1MiBps", 8 * 2**20),
    ("1gibps", 8 * 2**30),
    ("1tibps", 8 * 2**40),
    ("1.5mbit", 1_500_000),
    ("0.5kbit", 500),
    (".5gbit", 500_000_000),
    ("1e6", 10**6),
    ("2.5E3kbit", 2_500_000),
    ("8000", 8000),
    ("1000tbps", 8 * 10**15),
    # not whole bytes: tc truncates, we round to nearest (halves up), min 1
    ("12bit", 12),
    ("15bit", 15),
    ("1.5kbit", 1500),
    ("1bit", 1),
]


def floor_bytes(bits) -> int:
    return int(Fraction(bits) // 8)


def nearest_bytes(bits) -> int:
    q, r = divmod(Fraction(bits) / 8, 1)
    return max(1, int(q) + (1 if r >= Fraction(1, 2) else 0))


@pytest.mark.parametrize("text,bits", TABLE)
def test_parse_table(text, bits):
    assert parse_rate(text) == nearest_bytes(bits)


def test_rounding_rule():
    assert parse_rate("8bit") == 1
    assert parse_rate("11bit") == 1        # 1.375 -> 1
    assert parse_rate("12bit") == 2        # 1.5 -> 2 (halves up)
    assert parse_rate("1bit") == 1         # 0.125 -> minimum 1
    assert parse_rate("0.001bit") == 1
    assert parse_rate("1.5kbit") == 188    # 187.5 -> 188 (tc: 187)


def test_int_input_is_bits():
    assert parse_rate(8000) == 1000
    assert parse_rate(1) == 1
    with pytest.raises(ValueError, match="> 0"):
        parse_rate(0)


def test_percent():
    link = 125_000_000                     # 1gbit
    assert parse_rate("50%", link_bps=link) == 62_500_000
    assert parse_rate("100%", link_bps=link) == link
    assert parse_rate("0.5%", link_bps=link) == 625_000
    with pytest.raises(ValueError, match="needs link_rate"):
        parse_rate("50%")
    with pytest.raises(ValueError, match="<= 100%"):
        parse_rate("150%", link_bps=link)
    with pytest.raises(ValueError, match="> 0"):
        parse_rate("0%", link_bps=link)


@pytest.mark.parametrize("text,msg", [
    ("", "empty rate (expected e.g. '8mbit')"),
    ("   ", "empty rate (expected e.g. '8mbit')"),
    ("0", "'0': a rate must be > 0"),
    ("0mbit", "'0mbit': a rate must be > 0"),
    ("-1mbit", "'-1mbit': a rate must be > 0"),
    ("8mbits", "unknown rate unit 'mbits'; did you mean 'mbit'?"),
    ("8 mbit", "'8 mbit': no space between number and unit (write '8mbit', as tc wants it)"),
    ("fast", "not a rate: 'fast' (expected a number with a tc unit, e.g. '8mbit')"),
    ("0x100", "unknown rate unit 'x100'"),
    ("1e31", "exponent out of range in '1e31' (at most e30)"),
    ("18446744073709551616bps", "'18446744073709551616bps': rate too large (above 2^64-1 bytes/s)"),
    ("9" * 100, "(too long)"),
    ("inf", "not a rate: 'inf'"),
    ("nan", "not a rate: 'nan'"),
])
def test_parse_errors(text, msg):
    with pytest.raises(ValueError) as ei:
        parse_rate(text)
    assert msg in str(ei.value)
    assert "\n" not in str(ei.value)


def test_unknown_unit_lists_units_without_close_match():
    with pytest.raises(ValueError, match="units: bit kbit"):
        parse_rate("8furlongs")


def test_bad_types():
    for v in (True, None, 1.5, [1], {"a": 1}):
        with pytest.raises(ValueError):
            parse_rate(v)


def test_limits():
    assert parse_rate("18446744073709551615bps") == units.MAX_RATE_BPS
    assert parse_rate(format_rate(units.MAX_RATE_BPS)) == units.MAX_RATE_BPS


@pytest.mark.parametrize("bps,text,human", [
    (1, "1bps", "8 bit/s"),
    (125, "1kbit", "1 Kbit/s"),
    (1_000_000, "8mbit", "8 Mbit/s"),
    (25_000_000, "200mbit", "200 Mbit/s"),
    (125_000_000, "1gbit", "1 Gbit/s"),
    (128, "1kibit", "1.024 Kbit/s"),
    (1024, "8kibit", "8.192 Kbit/s"),
    (187, "187bps", "1.496 Kbit/s"),
    (187_500, "1500kbit", "1.5 Mbit/s"),
    (125_000_000_000, "1tbit", "1 Tbit/s"),
    (2**64 - 1, "18446744073709551615bps", "147573952.59 Tbit/s"),
])
def test_format(bps, text, human):
    assert format_rate(bps) == text
    assert format_bits(bps) == human
    assert parse_rate(text) == bps


def test_format_rate_round_trips():
    for n in list(range(1, 3000)) + [10**k for k in range(19)] + [2**k for k in range(64)]:
        assert parse_rate(format_rate(n)) == n, n


# ------------------------------------------------------- against tc itself

def _tc_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@pytest.fixture(scope="module")
def netns():
    if not _tc_available():
        pytest.fail("needs root and iproute2 (ip, tc): make test runs as root after make deps")
    name = f"fp-units-{secrets.token_hex(4)}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot create a network namespace: {r.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def tc_rate(ns: str, text: str):
    """What tc itself makes of a rate string: tbf on lo, read back as JSON
    (None when tc refuses it)."""
    r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", "lo", "root", "tbf",
                        "rate", text, "burst", "10k", "latency", "1ms"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None
    out = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", "lo"],
                         check=True, capture_output=True, text=True).stdout
    (q,) = [q for q in json.loads(out) if q.get("kind") == "tbf"]
    return int(q["options"]["rate"])


@pytest.mark.kernel
def test_units_agree_with_tc(netns):
    for text, bits in TABLE:
        got = tc_rate(netns, text)
        ours = parse_rate(text)
        if floor_bytes(bits) == 0:
            # tc truncates to 0 bytes/s and refuses; we give the minimum, 1 byte/s
            assert got is None and ours == 1, (text, got)
            continue
        # tc truncates bits/8; the table's exact value proves it read the unit as we do
        assert got == floor_bytes(bits), (text, got)
        if bits % 8 == 0:
            assert ours == got, text
        else:
            assert ours == nearest_bytes(bits) and abs(ours - got) <= 1, (text, ours, got)


@pytest.mark.kernel
def test_formatted_rates_read_back_by_tc(netns):
    for bps in (1, 125, 128, 187, 1000, 1_000_000, 1_250_000, 25_000_000, 125_000_000,
                1_048_576, 4_294_967_296, 125_000_000_000):
        assert tc_rate(netns, format_rate(bps)) == bps, format_rate(bps)


@pytest.mark.kernel
def test_percent_agrees_with_tc(netns):
    """tc takes NN% of the device's speed; a veth reports one (10000 Mb/s here):
    our NN% of the same link rate must agree."""
    subprocess.run(["ip", "-n", netns, "link", "add", "fpu0", "type", "veth", "peer", "name",
                    "fpu1"], check=True, capture_output=True)
    subprocess.run(["ip", "-n", netns, "link", "set", "fpu0", "up"], check=True)
    subprocess.run(["ip", "-n", netns, "link", "set", "fpu1", "up"], check=True)
    speed = subprocess.run(["ip", "netns", "exec", netns, "cat", "/sys/class/net/fpu0/speed"],
                           capture_output=True, text=True)
    if speed.returncode != 0 or int(speed.stdout.strip() or -1) <= 0:
        pytest.skip("this kernel's veth reports no speed")
    link = parse_rate(f"{int(speed.stdout)}mbit")
    for text in ("50%", "12.5%", "100%", "0.001%"):
        r = subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", "fpu0", "root", "tbf",
                            "rate", text, "burst", "10k", "latency", "1ms"],
                           check=True, capture_output=True, text=True)
        out = subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", "fpu0"],
                             check=True, capture_output=True, text=True).stdout
        (q,) = [q for q in json.loads(out) if q.get("kind") == "tbf"]
        assert parse_rate(text, link_bps=link) == int(q["options"]["rate"]), (text, r.stderr)


@pytest.mark.kernel
def test_tc_refuses_what_we_refuse(netns):
    for text in ("8mbits", "fast", "8 mbit"):
        assert tc_rate(netns, text) is None, text
        with pytest.raises(ValueError):
            parse_rate(text)


# ----------------------------------------------------- tc's byte units (issue 28 item 2)

@pytest.mark.parametrize("text,bits_reading,bytes_reading,spelling,keep", [
    ("320kbps", "320 Kbit/s", "2.56 Mbit/s", "320kbit", "2560kbit"),
    ("10mbps", "10 Mbit/s", "80 Mbit/s", "10mbit", "80mbit"),
    ("1gbps", "1 Gbit/s", "8 Gbit/s", "1gbit", "8gbit"),
    ("100Bps", "100 bit/s", "800 bit/s", "100bit", "800bit"),
    ("1.5MiBps", "1.573 Mbit/s", "12.583 Mbit/s", "1.5mibit", "12mibit"),
])
def test_byte_units_warn_with_both_readings_and_the_bit_spelling(text, bits_reading,
                                                                bytes_reading, spelling, keep):
    msg = units.byte_unit_warning(text)
    assert msg is not None
    assert f"= {bytes_reading} (the reading used)" in msg and f"= {bits_reading};" in msg
    assert f"write '{spelling}' for bits" in msg and f"'{keep}' to keep {bytes_reading}" in msg
    # what it says is what tc's parser gives: the value used, and both spellings it suggests
    assert units.format_bits(units.parse_rate(text)) == bytes_reading
    assert units.parse_rate(keep) == units.parse_rate(text)
    assert units.byte_unit_warning(keep) is None and units.byte_unit_warning(spelling) is None


@pytest.mark.parametrize("text", ["8mbit", "8000", 8000, "50%", "1.5gibit", "kbps", "8 mbps",
                                  None, "8xbps"])
def test_no_byte_unit_warning_for_anything_else(text):
    assert units.byte_unit_warning(text) is None


@pytest.mark.parametrize("text,msg", [
    ("10 Mbit/s", "'10 Mbit/s' is not a tc rate: write '10mbit'"),
    ("10Mbit/s", "'10Mbit/s' is not a tc rate: write '10mbit'"),
    ("2.5Gbit/s", "'2.5Gbit/s' is not a tc rate: write '2.5gbit'"),
    ("10 Mbits", "'10 Mbits': no space between number and unit (write '10mbit', as tc wants it)"),
    ("10 Mbps", "'10 Mbps': no space between number and unit, and 'Mbps' is tc's BYTES per "
                "second: write '10mbit' for 10 megabits/s ('10mbps' is tc's 10 megabytes/s, 8 "
                "times as much)"),
    ("10mbit/s", "'10mbit/s' is not a tc rate: write '10mbit'"),
])
def test_human_spellings_get_the_accepted_one(text, msg):
    with pytest.raises(ValueError) as ei:
        units.parse_rate(text)
    assert str(ei.value) == msg
    spelled = re.search(r"write '([^']+)'", msg).group(1)
    assert units.parse_rate(spelled) > 0 and units.byte_unit_warning(spelled) is None
