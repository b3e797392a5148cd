"""Rates as tc(8) writes them, converted to the model's unit: bytes per second.

The unit table is tc(8)'s "RATES" section (iproute2 ``tc/tc_util.c``), matched
case-insensitively as tc does:

=============  ======================  =============================
unit           meaning                 bits per second per unit
=============  ======================  =============================
(none), bit    bits per second         1
kbit           kilobits per second     1000
mbit, gbit,    mega/giga/tera bits     10**6, 10**9, 10**12
tbit
kibit, mibit,  IEC binary bits         2**10, 2**20, 2**30, 2**40
gibit, tibit
bps            BYTES per second        8
kbps, mbps,    kilo/mega/giga/tera     8 * 10**3 ... 8 * 10**12
gbps, tbps     bytes per second
kibps, mibps,  IEC binary bytes        8 * 2**10 ... 8 * 2**40
gibps, tibps
NN%            percent of link_rate    (only when the link rate is known)
=============  ======================  =============================

Numbers are decimal, optionally with a fraction and an exponent (``1.5mbit``,
``1e6``); arithmetic is exact (``fractions.Fraction``, never a float).

Rounding: the exact value in bits/s is divided by 8 and **rounded to the
nearest byte/s, halves up**, with a minimum of 1 byte/s for any positive rate.
(tc itself truncates: ``tc ... rate 15bit`` gives 1 byte/s, we give 2; the two
agree whenever the rate is a whole number of bytes per second, which every
practical rate is.)  Rates above 2**64-1 bytes/s (tc's 64-bit limit) are refused.
"""
from __future__ import annotations

import difflib
import re
from fractions import Fraction
from typing import Optional

from flowpacer.text import quoted as _show

MAX_RATE_BPS = 2**64 - 1          # bytes/s: tc's 64-bit rate
_MAX_EXPONENT = 30                # |e| in "1e6": bounded, so no giant integers
_MAX_TEXT = 64                    # characters in a rate string

# unit (lower case) -> bits per second for one unit
UNITS: dict[str, int] = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}

_NUMBER = r"(?P<num>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
_RATE_RE = re.compile(_NUMBER + r"(?P<unit>[A-Za-z]*|%)")
_SPACED_RE = re.compile(_NUMBER + r"\s+(?P<unit>[A-Za-z]+|%)")

# format_rate: largest unit first within each family
_DECIMAL_BITS = (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3))
_BINARY_BITS = (("tibit", 2**40), ("gibit", 2**30), ("mibit", 2**20), ("kibit", 2**10))
_HUMAN = (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6), ("Kbit/s", 10**3))


def _number(text: str) -> Fraction:
    mant, _, exp = text.lower().partition("e")
    value = Fraction(mant)
    if exp:
        e = int(exp)
        if abs(e) > _MAX_EXPONENT:
            raise ValueError(f"exponent out of range in {_show(text)} (at most e{_MAX_EXPONENT})")
        value *= Fraction(10) ** e
    return value


def bits_to_bps(bits: Fraction) -> int:
    """Exact bits/s -> bytes/s: round to nearest (halves up), at least 1 when positive."""
    q, r = divmod(Fraction(bits) / 8, 1)
    n = int(q) + (1 if r >= Fraction(1, 2) else 0)
    return max(n, 1) if bits > 0 else n


def parse_rate(text: object, link_bps: Optional[int] = None) -> int:
    """Parse a tc rate ("8mbit", "1.5gibit", "200kbps", "8000", "50%") into bytes/s.

    ``link_bps`` (bytes/s) is what a percentage is of; without it a percentage is
    refused.  Raises ``ValueError`` with a one-line reason for anything else.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"a rate must be text like '8mbit' or a number, not {type(text).__name__}")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"{text}: a rate must be > 0")
        if text > MAX_RATE_BPS * 8:
            raise ValueError("rate too large (above 2^64-1 bytes/s)")
        return bits_to_bps(Fraction(text))
    s = text.strip()
    if len(s) > _MAX_TEXT:
        raise ValueError(f"not a rate: {_show(s)} (too long)")
    if not s:
        raise ValueError("empty rate (expected e.g. '8mbit')")
    if s.startswith("-"):
        raise ValueError(f"{_show(s)}: a rate must be > 0")
    if s.startswith("+"):
        s = s[1:]
    m = _RATE_RE.fullmatch(s)
    if m is None:
        sp = _SPACED_RE.fullmatch(s) or _SPACED_RE.fullmatch(s.replace("/s", "ps", 1))
        if sp is not None and "/" not in s:
            if sp["unit"].lower() in BYTE_UNITS:
                raise ValueError(f"{_show(s)}: no space between number and unit, and "
                                 f"{_show(sp['unit'])} is tc's BYTES per second: write "
                                 f"{_spelling(sp['num'], sp['unit'])}")
            raise ValueError(f"{_show(s)}: no space between number and unit "
                             f"(write {_spelling(sp['num'], sp['unit'])}, as tc wants it)")
        lead = re.match(_NUMBER, s)
        if lead is not None and lead.end() < len(s):
            unit = s[lead.end():]
            accepted = _accepted_spelling(lead.group(), unit)
            if accepted:
                raise ValueError(f"{_show(s)} is not a tc rate: write {accepted}")
            raise ValueError(f"unknown rate unit {_show(unit)}{_unit_hint(unit)}")
        raise ValueError(f"not a rate: {_show(s)} (expected a number with a tc unit, e.g. '8mbit')")
    value = _number(m["num"])
    unit = m["unit"]
    if unit == "%":
        if link_bps is None:
            raise ValueError(f"{_show(s)}: a percentage needs link_rate in the rules file "
                             "(it is a percentage of link_rate)")
        if not 0 < value <= 100:
            raise ValueError(f"{_show(s)}: a percentage must be > 0% and <= 100%")
        bits = value / 100 * link_bps * 8
    else:
        mult = UNITS.get(unit.lower())
        if mult is None:
            raise ValueError(f"unknown rate unit {_show(unit)}{_unit_hint(unit)}")
        bits = value * mult
    if bits <= 0:
        raise ValueError(f"{_show(s)}: a rate must be > 0")
    bps = bits_to_bps(bits)
    if bps > MAX_RATE_BPS:
        raise ValueError(f"{_show(s)}: rate too large (above 2^64-1 bytes/s)")
    return bps


BYTE_UNITS = frozenset(u for u in UNITS if u.endswith("bps"))
_BYTE_WORDS = {"": "bytes", "k": "kilobytes", "m": "megabytes", "g": "gigabytes", "t": "terabytes",
               "ki": "kibibytes", "mi": "mebibytes", "gi": "gibibytes", "ti": "tebibytes"}
_BIT_WORDS = {"": "bits", "k": "kilobits", "m": "megabits", "g": "gigabits", "t": "terabits",
              "ki": "kibibits", "mi": "mebibits", "gi": "gibibits", "ti": "tebibits"}


def _bit_unit(unit: str) -> Optional[str]:
    """A unit as people write it ("Mbit/s", "Mbits", "kb/s" is not one) -> the tc bit unit it
    means ("mbit"), None when it names no bit unit of tc's."""
    u = unit.lower().replace(" ", "")
    if u.endswith("/s"):
        u = u[:-2]
    elif u.endswith("ps") and not u.endswith("bps"):
        u = u[:-2]
    if u.endswith("bits"):
        u = u[:-1]
    return u if u in UNITS and not u.endswith("bps") else None


def _spelling(num: str, unit: str) -> str:
    """The accepted spelling of NUM UNIT written with a space: the bit unit it means, and for a
    byte unit ("10 Mbps") both readings."""
    u = unit.lower()
    if u in BYTE_UNITS:
        prefix = u[:-3]
        bit = (prefix + "bit") if prefix else "bit"
        return (f"'{num}{bit}' for {num} {_BIT_WORDS[prefix]}/s ('{num}{u}' is tc's "
                f"{num} {_BYTE_WORDS[prefix]}/s, 8 times as much)")
    bit = _bit_unit(unit)
    return f"'{num}{bit or unit}'"


def _accepted_spelling(num: str, unit: str) -> Optional[str]:
    """"10Mbit/s", "10 Mbit/s", "10 Mbps" -> how tc wants it written, None when the unit
    means nothing known."""
    stripped = unit.strip()
    if stripped.lower() in BYTE_UNITS:
        return _spelling(num, stripped)
    bit = _bit_unit(stripped)
    return f"'{num}{bit}'" if bit else None


def byte_unit_warning(text: object) -> Optional[str]:
    """For a rate written with one of tc's BYTE units ("320kbps", "10mbps", "1Bps"): a one-line
    warning that spells out both readings and the bit spelling to write; None for any other
    rate (bit units, plain numbers, percentages, or text that is not a rate at all).

    tc reads "kbps" as kilobytes per second; in audio and ISP language it means kilobits.
    flowpacer keeps tc's meaning (the value is parsed as tc parses it) and says so."""
    if not isinstance(text, str):
        return None
    m = _RATE_RE.fullmatch(text.strip().lstrip("+"))
    if m is None or m["unit"].lower() not in BYTE_UNITS:
        return None
    num, unit = m["num"], m["unit"]
    u = unit.lower()
    prefix = u[:-3]
    bit = (prefix + "bit") if prefix else "bit"
    try:
        as_bytes = parse_rate(text)
        as_bits = _number(num) * UNITS[bit]
    except ValueError:
        return None
    keep = format_rate(as_bytes)
    if keep.endswith("bps"):            # no bit unit divides it: in plain bits
        keep = f"{as_bytes * 8}bit"
    return (f"{_show(text.strip())} uses tc's byte unit {_show(unit)}: {num} {_BYTE_WORDS[prefix]}/s "
            f"= {format_bits(as_bytes)} (the reading used), not {num} {_BIT_WORDS[prefix]}/s "
            f"= {_exact_bits(as_bits)}; write '{num}{bit}' for bits, or "
            f"'{keep}' to keep {format_bits(as_bytes)} without this warning")


def _unit_hint(unit: str) -> str:
    names = [u for u in UNITS if u]
    close = difflib.get_close_matches(unit.lower(), names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return "; units: bit kbit mbit gbit tbit kibit mibit gibit tibit (bits/s), " \
           "bps kbps mbps gbps tbps kibps mibps gibps tibps (BYTES/s), or NN%"


def format_rate(bytes_per_s: int) -> str:
    """bytes/s -> the exact tc string: the largest decimal bit unit that divides it
    ("8mbit"), else the largest binary one ("1kibit"), else "NNNbps".
    ``parse_rate(format_rate(n)) == n`` for every n >= 1."""
    n = int(bytes_per_s)
    bits = n * 8
    for family in (_DECIMAL_BITS, _BINARY_BITS):
        for name, mult in family:
            if bits % mult == 0:
                return f"{bits // mult}{name}"
    return f"{n}bps"


def format_bits(bytes_per_s: int) -> str:
    """bytes/s -> a human reading in bits/s: "8 Mbit/s", "1.5 Gbit/s", "96 bit/s"
    (SI prefixes, at most 3 decimals)."""
    bits = int(bytes_per_s) * 8
    for name, mult in _HUMAN:
        if bits >= mult:
            return f"{_decimals(Fraction(bits, mult))} {name}"
    return f"{bits} bit/s"


def format_bit_rate(bits_per_s: Optional[float]) -> str:
    """A measured rate in bits/s -> three significant digits: "9.49 Mbit/s", "999 bit/s"
    ("-" for None: not measured yet). For live figures (``top``, ``status``), where
    ``format_bits``'s exact decimals would be noise."""
    if bits_per_s is None:
        return "-"
    for name, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= div:
            return f"{bits_per_s / div:.3g} {name}"
    return f"{bits_per_s:.0f} bit/s"


def format_bytes(n: int) -> str:
    """A byte count -> three significant digits: "1.5 MB", "999 B" (SI prefixes)."""
    for name, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {name}"
    return f"{n} B"


def _exact_bits(bits: Fraction) -> str:
    """bits/s (exact, not rounded to bytes) -> "320 Kbit/s", "1 bit/s"."""
    for name, mult in _HUMAN:
        if bits >= mult:
            return f"{_decimals(Fraction(bits) / mult)} {name}"
    return f"{_decimals(Fraction(bits))} bit/s"


def _decimals(value: Fraction) -> str:
    scaled = _thousandths(value)
    whole, frac = divmod(scaled, 1000)
    return f"{whole}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(whole)


def _thousandths(value: Fraction) -> int:
    q, r = divmod(value * 1000, 1)
    return int(q) + (1 if r >= Fraction(1, 2) else 0)
