"""Text from the kernel, the rules file or a client, made safe to show: the one place it is done.

Process names, interface names, rule names and error texts may carry control characters (ESC
sequences, bidi overrides, newlines). Whatever shows them (the CLI, ``top``, metrics labels,
``rules edit``, the log) passes them through one of:

- ``printable``: every character that is not printable (C0/C1 controls, ESC, DEL, line and
  paragraph separators, bidi overrides ...) becomes its ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN``
  text; printable non-ASCII text (``café``) stays. For one-line messages and metrics labels.
- ``ascii_only``: printable ASCII as is, everything else escaped the same way: of known width
  on any terminal (``top``'s columns).
- ``quoted``: a user's text inside a one-line error message (rules, rates): Python-quoted
  (escaped) and bounded.
"""
from __future__ import annotations


def _escape(c: str) -> str:
    o = ord(c)
    if o < 0x100:
        return f"\\x{o:02x}"
    return f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def printable(text) -> str:
    """``text`` (any object, as ``str``) with every non-printable character escaped."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def quoted(text: str, limit: int = 40) -> str:
    """A user's text for a one-line message: escaped, quoted, bounded to ``limit`` characters."""
    s = text if len(text) <= limit else text[:limit] + "..."
    return repr(s)


def ascii_only(text) -> str:
    """``text`` (any object, as ``str``) as printable ASCII: everything else escaped."""
    return "".join(c if 0x20 <= ord(c) < 0x7F else _escape(c) for c in str(text))
