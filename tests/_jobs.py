# Running multi-process jobs (torchrun, `shardwise launch`) from tests.
"""Start commands side by side, wait for all, and rerun once on torch's teardown abort.

A worker that dies at interpreter exit with SIGABRT and "terminate called without an active
exception", after the script has finished, is torch's teardown race: a gloo thread releasing
work that holds a Python object while the interpreter finalizes (about 1 exit in 300 here
when shardwise still ended jobs with a gloo barrier; it now meets on the store, see
docs/guide.md). A script's own gloo work can still hit it, so a job that fails with exactly
that message is run once more; every other failure, and the same abort twice, fails the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

TEARDOWN_ABORT = "terminate called without an active exception"

Result = tuple[int | None, str, str]  # returncode, stdout, stderr


def _kill_tree(p: subprocess.Popen[str]) -> None:
    """Kill the command and everything it started (torchrun's workers hold its pipes open)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _run_once(cmds: list[list[str]], timeout: float, **kwargs: Any) -> list[Result]:
    # each command leads its own process group, so a stuck job is killed with its children
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, **kwargs)
             for cmd in cmds]
    deadline = time.monotonic() + timeout
    late = False
    try:
        # one failed machine leaves the others waiting at torchrun's exit barrier: stop early
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                late = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_tree(p)  # also a finished launcher's strays: none may outlive the test
    results: list[Result] = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a stray outside the group still holds a pipe
            p.kill()
            out, err = "", "its output pipes stayed open after it was killed"
        if late and p.returncode is not None and p.returncode < 0:
            err += f"\n[run_jobs: killed after {timeout} s]"
        results.append((p.returncode, out, err))
    return results


def run_jobs(cmds: list[list[str]], *, timeout: float = 240, **kwargs: Any) -> list[Result]:
    """Run ``cmds`` at once; (returncode, stdout, stderr) of each. A command still running
    at ``timeout`` seconds, or after another one failed, is killed (returncode < 0)."""
    results = _run_once(cmds, timeout, **kwargs)
    if any(rc != 0 for rc, _, _ in results) and any(TEARDOWN_ABORT in err for _, _, err in results):
        results = _run_once(cmds, timeout, **kwargs)
    return results
