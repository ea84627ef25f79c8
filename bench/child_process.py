"""One child process under a time limit, its output copied as it comes, and every process it started
stopped with it (the GPU check's sections, bench/gpu_check.py; docs/gpu.md "GPU check").

A child's own process group is not enough to stop what it started: torchrun starts its workers with
`start_new_session`, inductor's compile workers and a reward pool start their own, and a process
whose parent exits is re-parented, so neither the group nor the parent links found at the end reach
it. So the process tree below the child is read from /proc while the child runs (each process by
pid and start time, so a reused pid is never taken for it), the check process becomes a child
subreaper (Linux: an orphan below it is re-parented to it rather than to init), and at the end,
whether the child finished, failed or ran out of time, every process seen below it that still runs
is stopped: SIGTERM, then SIGKILL after a grace period. The output is read with os.read on the pipe
once select says it is readable, so a partial line (a progress bar, a hung write) never blocks the
reader past the limit; whole lines are copied to the log and to standard output.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

GRACE_S = 3.0              # SIGTERM, then this long before SIGKILL (a train.py stopped by SIGTERM would
                           # spend it saving a checkpoint the check does not need)
POLL_S = 0.5               # the longest wait between two readings of the process tree
PR_SET_CHILD_SUBREAPER = 36
_SUBREAPER = False         # this process is its descendants' subreaper: orphans below it come here


def write_figures(path: str, figures) -> None:
    """A child's figures as JSON, written whole (a temporary file, then os.replace): a child stopped
    mid-write leaves the figures it wrote last, never half a file. Children write after each
    measurement, so a section past its limit keeps what was measured before it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(figures, f, indent=1)
    os.replace(tmp, path)


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux prctl); False where it cannot.
    Call it in a process whose children are all run by run_child (the check's own process): from then
    on, a process re-parented to it that run_child did not start is taken for an orphan of the child
    being stopped."""
    global _SUBREAPER
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _SUBREAPER = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every running process (zombies left out),
    from /proc/PID/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:                                  # it exited meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2:].split()   # after "(command)", which may hold spaces
        if fields[0] in (b"Z", b"X"):                    # state: a zombie is dead, its children re-parented
            continue
        table[int(name)] = (int(fields[1]), int(fields[19]))   # stat fields 4 (ppid) and 22 (starttime)
    return table


def below(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """Every process in `table` under one of `roots` (children, theirs, ...), the roots left out."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class ProcessTree:
    """The processes below one child, as seen while it ran: pid -> start time."""

    def __init__(self, root: int, others: Callable[[], set[int]] = lambda: set()):
        self.root = root
        self.others = others             # pids of this process's other children (not ours to stop)
        self.seen: dict[int, int] = {}

    def update(self, table: dict[int, tuple[int, int]] | None = None) -> dict[int, tuple[int, int]]:
        table = process_table() if table is None else table
        live = {pid for pid, start in self.seen.items() if table.get(pid, (0, -1))[1] == start}
        for pid in below({self.root} | live, table) | ({self.root} & table.keys()):
            self.seen.setdefault(pid, table[pid][1])
        return table

    def running(self) -> set[int]:
        """Every process of the tree still running: seen ones (same start time), what runs below them,
        and orphans re-parented to this process (a subreaper) that are not its other children."""
        table = self.update()
        mine = {pid for pid, start in self.seen.items() if table.get(pid, (0, -1))[1] == start}
        orphans = ({pid for pid, (ppid, _) in table.items() if ppid == os.getpid()} - self.others() - {self.root}
                   if _SUBREAPER else set())
        return (mine | orphans | below(mine | orphans, table)) - {os.getpid()}


def stop(tree: ProcessTree, log, grace: float = GRACE_S) -> int:
    """SIGTERM to every running process of the tree (and the child's process group), SIGKILL to those
    left after `grace` seconds; the number of processes signalled. Orphans re-parented here are reaped."""
    targets = tree.running()
    if not targets:
        return 0
    try:
        os.killpg(tree.root, signal.SIGTERM)
    except OSError:                                     # the group is gone (or was never its own)
        pass
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and tree.running() & targets:
        _reap(targets)
        time.sleep(0.1)
    left = tree.running() & targets
    for pid in left:
        _signal(pid, signal.SIGKILL)
    time.sleep(0.1)
    _reap(targets)
    log.write(f"[stopped {len(targets)} process(es) of this child{f', {len(left)} with SIGKILL' if left else ''}]\n")
    return len(targets)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:                                     # exited meanwhile
        pass


def _reap(pids: set[int]) -> None:
    """Collect the exit status of those of `pids` that are (re-parented) children of this process."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:                       # not a child of ours, or already collected
            pass


_RUNNING: set[int] = set()                              # pids of the children run_child runs now (threads)
_LOCK = threading.Lock()


def run_child(argv: list[str], log, limit: float, *, cwd: str | None = None, env: dict | None = None,
              done: Callable[[], bool] | None = None, cancel: threading.Event | None = None,
              echo: bool = True) -> str:
    """Run argv in a new process group of its own (setsid), its output appended to `log` (and echoed to
    standard output), for at most `limit` seconds: "ok", "exit N", "timed out", or "cancelled" (`cancel`
    set). `done()` true (checked about every POLL_S) ends it early as "ok": its figures are in. Every process it started
    is stopped when it ends, whichever way."""
    log.write("$ " + " ".join(argv) + "\n")
    log.flush()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    with _LOCK:
        _RUNNING.add(proc.pid)
    tree = ProcessTree(proc.pid, others=lambda: _RUNNING - {proc.pid})
    try:
        status = _follow(proc, tree, log, time.monotonic() + limit, done, cancel, echo)
    finally:                                            # an exception here too (SIGTERM to the check)
        stop(tree, log)
        proc.wait()
        with _LOCK:
            _RUNNING.discard(proc.pid)
        log.flush()
    return status


def _follow(proc: subprocess.Popen, tree: ProcessTree, log, deadline: float, done, cancel, echo: bool) -> str:
    """Copy the child's output line by line until it exits, `done()`, `cancel` or the deadline."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    pending = b""

    def emit(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        if data is pending and text and not text.endswith(("\n", "\r")):
            text += "\n"                                  # the last, unfinished line
        log.write(text)
        if echo:
            sys.stdout.write(text)
            sys.stdout.flush()

    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            emit(pending)
            log.write(f"[{'cancelled' if left > 0 else 'killed: over its time limit'}]\n")
            return "cancelled" if left > 0 else "timed out"
        ready, _, _ = select.select([fd], [], [], min(left, POLL_S))
        tree.update()
        chunk = b""
        if ready:
            try:
                chunk = os.read(fd, 1 << 16)            # what is there, never more: no wait for a newline
            except BlockingIOError:
                chunk = None
            if chunk == b"":                            # end of output: every writer closed the pipe
                break
            pending += chunk or b""
            lines, newline, pending = pending.rpartition(b"\n")
            if newline:
                emit(lines + newline)
            if len(pending) > 1 << 16 or b"\r" in pending:   # a progress bar's line: out as it is
                emit(pending)
                pending = b""
        if proc.poll() is not None and not ready:
            break                                       # exited; a process it left may hold the pipe open
        if done is not None and done():
            emit(pending)
            log.write("[stopped: its figures are in]\n")
            return "ok"
    emit(pending)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        log.write("[killed: over its time limit]\n")
        return "timed out"
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
