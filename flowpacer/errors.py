"""Errors shared by all stages. Every message is one line, fit for a log or a terminal."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


class FlowpacerError(Exception):
    """Base class: an expected failure with a one-line reason (never a traceback)."""


@dataclass(frozen=True)
class RuleProblem:
    path: str
    line: int
    col: int
    message: str          # already includes "rule 'NAME': FIELD: " where it applies

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.message}"


class RulesError(FlowpacerError):
    """A rules file was refused; ``problems`` lists every reason at once."""

    def __init__(self, problems: List[RuleProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class NetlinkError(FlowpacerError):
    """The kernel refused a request. ``extack`` is the kernel's own text, if it sent one."""

    def __init__(self, what: str, errno_: int, extack: Optional[str] = None):
        self.what = what
        self.errno = errno_
        self.extack = extack
        import os
        reason = os.strerror(errno_) if errno_ else "error"
        msg = f"{what}: {reason}"
        if extack:
            msg += f" ({extack})"
        super().__init__(msg)


class BackendError(FlowpacerError):
    """The backend cannot do its job (interface missing, root qdisc occupied, ...)."""


class TracerUnavailable(FlowpacerError):
    """The eBPF tracer cannot run here; the message says exactly what is missing."""
