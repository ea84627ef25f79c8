"""Running reward functions safely: each call under a time limit, and off the critical path in a
pool of worker processes.

Time limits. math-verify guards itself with `signal.alarm` (whole seconds, main thread only, and
it overwrites any outer alarm); pspo/rewards.py switches its guards off and this module puts one
guard of its own around every reward-function call (`guarded_call` inside `alarm_guard`):
`signal.setitimer(ITIMER_REAL, timeout_s)` with a handler raising `_RewardTimeout`, a
BaseException so that math-verify's many `except Exception` blocks cannot swallow it. An outer
ITIMER_REAL timer (e.g. pytest-timeout) is paused during the batch and re-armed afterwards with
what was left of it. Signals reach only the main thread, so scoring raises RuntimeError elsewhere
rather than run without a limit. A signal cannot interrupt one long C call (a regex); the input
caps of pspo/rewards.py keep those short. `score_calls` runs a batch so in this process.

A pool. `concurrent.futures.ProcessPoolExecutor` and `multiprocessing.Pool` cannot stop one call:
`result(timeout)` / `get(timeout)` only stop waiting, a call stuck in C code keeps its worker busy
until it returns, and neither kills one worker and goes on. A worker that dies breaks a
ProcessPoolExecutor (every pending call fails with BrokenProcessPool, and it takes no more);
multiprocessing.Pool starts a new worker but never answers the call the dead one held (only a
timeout on `get` notices). So the pool is written here:

`RewardPool(workers)` keeps `workers` long-lived processes, each a fresh interpreter started with
`python -c` (never a fork of a trainer holding torch threads, CUDA or vLLM; and not
multiprocessing's "spawn", which re-runs the trainer's main script, ~6 s of torch and transformers
imports per worker). A worker imports pspo.rewards only (math-verify, no torch: ~0.7 s) and
scores in the background while the trainer loads its model. `pool.score` is
`score_calls` spread over the workers, with the same values and failure counts:

- the batch is cut into contiguous chunks of completions (a group's identical answers stay in one
  worker, whose memo in pspo/rewards.py then serves them), handed to workers as they fall idle;
- a worker makes exactly the in-process calls, `guarded_call` under `alarm_guard`: the per-call
  limit `timeout_s` is its own SIGALRM, as in the trainer, and it answers call by call;
- the reward functions travel by name (pickle: module and name), looked up in
  REWARD_FUNCTIONS per batch as in the trainer, so a test's module-level reward reaches the workers too;
  a worker runs with the trainer's sys.path. It sees the modules as imported, not later changes
  the trainer makes to them (a monkeypatched constant).

When a worker fails. The guard cannot interrupt everything (one long C call, a blocked or ignored
SIGALRM), and a worker can die (os._exit, a segfault, the OOM killer). So the trainer also gives
each call `timeout_s + GRACE_S` of wall time: a worker silent for longer is killed (SIGKILL). The
call a killed or dead worker had not answered scores 0 and counts in failures[name], as a time-out
in the trainer does; the rest of its chunk goes back in the queue, a fresh worker takes its place,
and one line goes to stderr. Each loss uses up one call, so every batch ends.

Functions a worker cannot load (a lambda, a local function, one defined in a script run as
`__main__`) are scored in the trainer instead, with a one-time warning; so is a batch whose
worker is lost before it has loaded the functions.

Lifetime: `close()` (train.py and eval.py call it) kills the workers, as does the pool's garbage
collection or the interpreter's exit (weakref.finalize). A worker also exits when its pipe to the
trainer closes, and on Linux gets SIGKILL when the trainer dies (PR_SET_PDEATHSIG). Workers run in
their own process group (start_new_session): Ctrl-C reaches the trainer only, which stops them.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait

from pspo.tasks.golds import GoldAnswerError

START_S = 60.0             # seconds a (new) worker may take to start and load the functions of a chunk
GRACE_S = 1.0              # seconds past timeout_s a worker may stay silent on one call before it is killed
CHUNKS_PER_WORKER = 4      # chunks per worker and batch: a slow chunk does not leave the others idle
PR_SET_PDEATHSIG = 1       # prctl option, <linux/prctl.h>


# ---- one call under a time limit, in this process ----------------------------------------

RewardFn = Callable[[str, str, str], float]
Values = tuple[dict[str, list[float]], dict[str, int]]   # (name -> (N,) values, name -> failures)


class _RewardTimeout(BaseException):
    """Raised by our SIGALRM handler; a BaseException so `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _RewardTimeout()


@contextlib.contextmanager
def alarm_guard() -> Iterator[None]:
    """Install our SIGALRM handler for a batch; pause and afterwards re-arm any outer timer."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("score_completions must run in the main thread: its per-call time "
                           "limit uses SIGALRM, which Python delivers only there")
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    outer_handler = signal.signal(signal.SIGALRM, _on_alarm)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # getsignal() reports None for a handler not installed from Python; SIG_DFL is the closest.
        signal.signal(signal.SIGALRM, signal.SIG_DFL if outer_handler is None else outer_handler)
        if outer_delay > 0:                              # fires at once if it expired meanwhile
            remaining = max(outer_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def guarded_call(fn: RewardFn, args: tuple[str, str, str], timeout_s: float) -> float | None:
    """fn(*args) limited to `timeout_s` seconds, inside `alarm_guard`: its finite value, or None if
    it raised, returned a non-finite value or ran past the limit. GoldAnswerError propagates."""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            value = float(fn(*args))
        finally:                                         # an alarm that fires in here lands below
            signal.setitimer(signal.ITIMER_REAL, 0)
    except GoldAnswerError:
        raise
    except (Exception, _RewardTimeout):                  # the caller scores 0 and counts it
        return None
    return value if math.isfinite(value) else None


def score_calls(fns: dict[str, RewardFn], prompts: list[str], completions: list[str], golds: list[str],
                timeout_s: float) -> Values:
    """Every function on every completion in this process: (values, failures), a failed call 0.0."""
    values = {name: [0.0] * len(completions) for name in fns}
    failures = dict.fromkeys(fns, 0)
    with alarm_guard():
        for name, fn in fns.items():
            for i, args in enumerate(zip(prompts, completions, golds)):
                value = guarded_call(fn, args, timeout_s)
                if value is None:
                    failures[name] += 1
                else:
                    values[name][i] = value
    return values, failures


# ---- the pool of worker processes ----------------------------------------------------------

def resolve_workers(workers: int, train_threads: int) -> int:
    """reward.workers -> a number of processes. -1 (auto): the cores this process may run on, shared
    evenly among the ranks on this node (torchrun's LOCAL_WORLD_SIZE), less its `train_threads`
    (torch.get_num_threads()), at least 0: 2 cores and 2 threads -> 0 (score in the trainer);
    64 cores, 8 ranks of 1 thread -> 7 per rank."""
    if workers >= 0:
        return workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, cores // local_ranks - train_threads)


class _CannotLoad(Exception):
    """A worker could not load the reward functions (or was lost before it did)."""


class _Worker:
    """One worker process, its pipe, and the calls it owes the trainer, in order."""

    def __init__(self) -> None:
        self.conn, child = multiprocessing.Pipe()
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"from pspo.tasks.reward_pool import worker_main; worker_main({child.fileno()})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        child.close()
        self.blob: bytes | None = None          # the pickled functions it holds
        self.calls: list[tuple[str, int]] = []  # (name, completion index) sent, not yet answered
        self.loaded = False                     # it has loaded the functions of its current chunk
        self.deadline = math.inf                # time.monotonic() by which it must answer again

    def stop(self) -> None:
        self.proc.kill()                        # a worker holds nothing worth a graceful exit
        self.proc.wait()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class RewardPool:
    """`workers` reward processes (0: none, `score` runs in this process); see the module docstring."""

    def __init__(self, workers: int) -> None:
        if workers < 0:
            raise ValueError(f"RewardPool: expected workers >= 0, got {workers}")
        self._workers = [_Worker() for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        self.replaced = 0                       # workers killed or found dead, and started anew
        self._unloadable: bytes | None = None   # functions a worker failed to load: scored here
        self._warned: set[tuple[str, ...]] = set()            # the names of the functions warned about

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Kill the workers (idempotent); later batches are scored in this process."""
        self._finalizer()

    def score(self, fns: dict[str, RewardFn], prompts: list[str], completions: list[str],
              golds: list[str], timeout_s: float) -> Values:
        """`score_calls(fns, prompts, completions, golds, timeout_s)`, in the workers."""
        if not self._workers:
            return score_calls(fns, prompts, completions, golds, timeout_s)
        try:
            blob = pickle.dumps(fns)
        except (pickle.PicklingError, AttributeError, TypeError) as e:   # a lambda, a local function
            return self._in_process(str(e), fns, prompts, completions, golds, timeout_s)
        if blob == self._unloadable:
            return self._in_process("a worker failed to load them", fns, prompts, completions, golds,
                                    timeout_s)
        try:
            return self._score(blob, list(fns), prompts, completions, golds, timeout_s)
        except _CannotLoad as e:
            return self._in_process(str(e), fns, prompts, completions, golds, timeout_s)

    def _in_process(self, why: str, fns: dict[str, RewardFn], prompts: list[str], completions: list[str],
                    golds: list[str], timeout_s: float) -> Values:
        if tuple(fns) not in self._warned:
            warnings.warn(f"reward pool: the reward functions {sorted(fns)} cannot be sent to a worker "
                          f"({why}); they are scored in this process (define them at module level)")
            self._warned.add(tuple(fns))
        return score_calls(fns, prompts, completions, golds, timeout_s)

    def _score(self, blob: bytes, names: list[str], prompts: list[str], completions: list[str],
               golds: list[str], timeout_s: float) -> Values:
        n = len(completions)
        values = {name: [0.0] * n for name in names}
        failures = dict.fromkeys(names, 0)
        gold_errors: list[tuple[int, int, str]] = []              # (name's position, i, message)
        size = max(1, math.ceil(n / (len(self._workers) * CHUNKS_PER_WORKER)))
        todo = deque([(name, i) for i in range(start, min(start + size, n)) for name in names]
                     for start in range(0, n, size))              # completion-major chunks of calls

        def answer(w: _Worker, reply: tuple[str, float | str | None]) -> None:
            kind, payload = reply
            if kind == "load_error":             # the same next time: do not try again
                self._unloadable = blob
                raise _CannotLoad(payload)
            if kind == "loaded":
                w.loaded = True
            else:
                name, i = w.calls.pop(0)
                if kind == "gold_error":
                    gold_errors.append((names.index(name), i, payload))
                elif payload is None:
                    failures[name] += 1
                else:
                    values[name][i] = payload
            w.deadline = time.monotonic() + timeout_s + GRACE_S if w.calls else math.inf

        def lose(k: int, killed: bool) -> None:
            w = self._workers[k]
            if not w.loaded:
                raise _CannotLoad("a worker was lost while loading them")
            name, i = w.calls[0]
            failures[name] += 1                                   # the call it owed scores 0
            if w.calls[1:]:
                todo.appendleft(w.calls[1:])
            w.calls = []
            self._replace(k)
            why = (f"was silent past timeout_s={timeout_s:g} s + {GRACE_S:g} s and was killed" if killed
                   else f"died (exit code {w.proc.returncode})")
            print(f"reward pool: a worker {why} on reward {name!r} (completion {i} of {n}); a new one "
                  "took its place and the call scores 0", file=sys.stderr)

        try:
            while True:
                for k, w in enumerate(self._workers):
                    if not w.calls and todo:
                        self._send(k, todo.popleft(), blob, prompts, completions, golds, timeout_s)
                busy = [k for k, w in enumerate(self._workers) if w.calls]
                if not busy:
                    break
                soonest = min(self._workers[k].deadline for k in busy)
                ready = wait([self._workers[k].conn for k in busy], max(0.0, soonest - time.monotonic()))
                for k in busy:
                    w = self._workers[k]
                    try:
                        while w.calls and w.conn in ready and w.conn.poll():
                            answer(w, w.conn.recv())
                    except (EOFError, OSError):
                        lose(k, killed=False)
                        continue
                    if w.calls and time.monotonic() > w.deadline:
                        lose(k, killed=True)
        finally:                                 # an error or interrupt: no worker may owe stale answers
            for w in self._workers:
                if w.calls:
                    w.stop()                     # `_send` starts a new one when it is needed
                    w.calls = []
        if gold_errors:                          # the one the in-process loop would have met first
            raise GoldAnswerError(min(gold_errors)[2])
        return values, failures

    def _send(self, k: int, calls: list[tuple[str, int]], blob: bytes, prompts: list[str],
              completions: list[str], golds: list[str], timeout_s: float) -> None:
        w = self._workers[k]
        if w.proc.poll() is not None:           # stopped, or died while idle: it owes nothing
            w = self._replace(k)
        job = [(name, prompts[i], completions[i], golds[i]) for name, i in calls]
        w.calls, w.loaded, w.deadline = calls, False, time.monotonic() + START_S
        try:
            w.conn.send((blob if w.blob != blob else None, job, timeout_s))
        except OSError as e:
            raise _CannotLoad(f"a worker's pipe broke ({e})") from None
        w.blob = blob

    def _replace(self, k: int) -> _Worker:
        self._workers[k].stop()
        self.replaced += 1
        self._workers[k] = _Worker()
        return self._workers[k]


def worker_main(fd: int) -> None:
    """A worker's loop, started by RewardPool: a chunk in, ("loaded", None) then one reply per call out."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    conn = Connection(fd)
    fns: dict[str, RewardFn] = {}
    with alarm_guard():
        while True:
            try:
                blob, job, timeout_s = conn.recv()
            except EOFError:                    # the trainer closed the pool, or died
                return
            if blob is not None:
                try:
                    fns = pickle.loads(blob)
                except Exception as e:          # e.g. a module the trainer imported from elsewhere
                    conn.send(("load_error", f"{type(e).__name__}: {e}"))
                    continue
            conn.send(("loaded", None))
            for name, prompt, completion, gold in job:
                try:
                    conn.send(("value", guarded_call(fns[name], (prompt, completion, gold), timeout_s)))
                except GoldAnswerError as e:
                    conn.send(("gold_error", str(e)))
