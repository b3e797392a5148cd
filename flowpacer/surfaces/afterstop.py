"""What the unit's ExecStopPost= does once the daemon has exited (issue 28: restarts without a gap).

The unit runs the daemon with ``--keep-on-exit``: on SIGTERM it leaves its qdisc, classes and
filters in the kernel, so that a restarted process (``systemctl restart``, a package upgrade's
postinst, systemd's Restart=on-failure) adopts every live flow's class before it removes
anything, and no flow runs unshaped meanwhile. ExecStopPost= then runs
``flowpacer cleanup --all --after-stop %n`` and ``decide`` says whether this stop is the end:

  a restart job of the unit is running      keep: the next process adopts them
  a stop job of the unit is running         remove (systemctl stop, apt remove, shutdown)
  no job; the daemon exited 0               remove (nothing will start it again)
  no job; exit status 2 (invalid rules)     remove (RestartPreventExitStatus=2: no restart)
  no job; any other failure                 keep: Restart=on-failure starts it again and the
                                            new process adopts the live flows (a start
                                            limit reached leaves them: ``flowpacer cleanup``)

systemd tells ExecStopPost= how the service ended ($SERVICE_RESULT, $EXIT_CODE, $EXIT_STATUS;
systemd.exec(5)) but not which job stops it: that is asked with ``systemctl list-jobs``. When
systemctl cannot answer, the result alone decides.
"""
from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

log = logging.getLogger(__name__)

SYSTEMCTL = "systemctl"


@dataclass(frozen=True)
class Decision:
    remove: bool
    why: str


def unit_job(unit: str, run: Callable = subprocess.run) -> Optional[str]:
    """The type of the job of ``unit`` that systemd is running (``restart``, ``stop``,
    ``start`` ...), "" when there is none, None when systemctl cannot tell."""
    try:
        p = run([SYSTEMCTL, "list-jobs", "--no-legend", "--no-pager", "--full"],
                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("systemctl list-jobs: %s", e)
        return None
    if p.returncode != 0:
        log.debug("systemctl list-jobs: exit %d: %s", p.returncode, p.stderr.strip())
        return None
    return parse_jobs(p.stdout, unit)


def parse_jobs(text: str, unit: str) -> str:
    """``systemctl list-jobs --no-legend`` lines are ``JOB UNIT TYPE STATE``: the TYPE of
    ``unit``'s job, "" when it has none."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].isdigit() and parts[1] == unit:
            return parts[2]
    return ""


def decide(job: Optional[str], env: Mapping[str, str]) -> Decision:
    """Remove or keep flowpacer's kernel objects, from the unit's job (``unit_job``) and the
    environment systemd gives ExecStopPost=."""
    result = env.get("SERVICE_RESULT", "")
    code, status = env.get("EXIT_CODE", ""), env.get("EXIT_STATUS", "")
    if job in ("restart", "try-restart", "reload-or-restart", "reload-or-try-restart"):
        return Decision(False, f"a {job} job: the next process adopts the classes")
    if job == "stop":
        return Decision(True, "a stop job")
    if result in ("", "success"):
        return Decision(True, "the daemon exited successfully and no restart is queued")
    if code == "exited" and status == "2":
        return Decision(True, "invalid rules (exit status 2): systemd does not restart it")
    return Decision(False, f"the service failed ({result}, {code or '-'} {status or '-'}): "
                           "Restart=on-failure starts it again and it adopts the classes")


def after_stop(unit: str, env: Optional[Mapping[str, str]] = None,
               job_of: Optional[Callable[[str], Optional[str]]] = None) -> Decision:
    return decide((job_of or unit_job)(unit), os.environ if env is None else env)
