"""An engine in its own process (asynchronous rollouts, docs/gpu.md "One step off"): its start, its lifetime
and the protocol it speaks with the trainer's rank 0.

Start. Like reward_pool.py's workers: a fresh interpreter (`python -c`, the trainer's sys.path; never a
fork of a process holding CUDA, threads or vLLM, and not multiprocessing's "spawn", which re-imports
train.py), a process group of its own via setsid (a Ctrl-C to the terminal reaches the trainer only,
which decides when the engine ends: it may still need the step in flight for its checkpoint),
PR_SET_PDEATHSIG = SIGKILL (the trainer's death, kill -9 included, kills it; it fires when the *thread*
that started the child exits, so engines start from the main thread only), and EOF on its pipe as the
second way out. The staging buffer's fd (engines/staging.py) is passed to it.

Protocol: over a socket pair (the pipe), a message is its pickle's length (8 bytes, big-endian), then the
pickle. Plain pickle rather than `Connection.send`, which would hand torch tensors over as fds through
multiprocessing's resource sharer, which a `python -c` child cannot reach (it lacks the parent's authkey);
plain pickle sends them by value.

    trainer -> engine                       engine -> trainer
    EngineSpec (once, first)                ("ready", pid, start-up seconds)
    Generate(step, version, ...)            ("loaded", version, load_s, row sums | None): it has read the
                                              staging buffer (which may now be overwritten); sent when the
                                              version differs from the one it holds, or a check is asked
                                            ("rollout", step, version, Rollout, gen_s, idle_s)
    Stop()                                  (exits 0)
    (any request)                           ("error", one line), then exits 1: an engine error is fatal

Deadlines. The engine's side blocks; the trainer's never does: its end of the pipe is non-blocking, and every
byte it reads or writes waits under a `Deadline` (`EngineProcess.wait_for`, `send`), checking every
WAIT_TICK_S that the engine is alive. A message counts when it is whole: an engine that stalls after part of
one (half-read), or stops reading a request that fills the pipe (a hung send), is met by the deadline like a
silent one. An exit or EOF, an ("error", ...) answer or a deadline passed becomes EngineError, one line
naming the engine, its pid and what it was doing; the engine is then killed (its whole process group).
One deadline covers one wait of rank 0, for every engine and every message in it (engines/schedule.py says
which waits): a deadline is not restarted by an answer, so E engines slow by 0.6 of it each end the wait at
the deadline, not at 0.6·E. `stop_all` gives the engines STOP_GRACE_S in all.
"""
from __future__ import annotations

import mmap
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pspo.engines.staging import Layout, row_sums, views
from pspo.engines.vllm_engine import ADAPTER_PREFIX
from pspo.training.config import LoraConfig, error_line
from pspo.training.lora import peft_key

PR_SET_PDEATHSIG = 1           # prctl option, <linux/prctl.h>
WAIT_TICK_S = 0.5              # seconds between two liveness checks of a waited-for engine
STOP_GRACE_S = 5.0             # seconds the stopped engines may take to exit, all together, before they are killed
LENGTH = struct.Struct("!Q")   # a message's first 8 bytes: its pickle's length
# torchrun's variables (and every TORCHELASTIC_*): an engine is no rank of the trainer's process group (vLLM would
# read them as its own)
LAUNCHER_VARS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


class EngineError(RuntimeError):
    """An engine process died, failed, or did not answer in time: the run stops (exit 2)."""


@dataclass(frozen=True)
class Deadline:
    """When one wait of the trainer on its engines must end (time.monotonic()), shared by every engine and every
    message of the wait (module docstring)."""
    at: float
    seconds: float                  # its length (rollout.engine_timeout_s), for the error line

    @staticmethod
    def after(seconds: float, since: float | None = None) -> Deadline:
        """`seconds` after `since` (time.monotonic(); default now)."""
        return Deadline((time.monotonic() if since is None else since) + seconds, seconds)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process builds (sent once, first)."""
    kind: str                       # "hf" (transformers, engines/hf_engine.py) | "vllm" (engines/vllm_engine.py)
    model_path: str                 # the base model: the weights come through the staging buffer
    trust_remote_code: bool
    max_len: int                    # longest prompt + rollout.max_new_tokens
    batch_size: int                 # rollout.batch_size
    compile: bool                   # the decoding step compiled (rollout.compile resolved)
    lora: LoraConfig | None         # the adapters it carries (model.lora), None without LoRA
    bf16: bool                      # model.bf16: on GPU, hf autocasts as the trainer's policy, vLLM holds bf16
    seed: int                       # train.seed (vLLM's engine seed; every request carries its own seeds)
    gpu_memory_utilization: float   # vLLM: its share of the GPU (rollout.gpu_memory_utilization)
    threads: int                    # torch threads: the trainer's, so that the matmuls block alike
    cores: tuple[int, ...] = ()     # cores to pin to (rollout.engine_cores); () = inherited
    adapter_dir: str = ""           # vLLM with LoRA: where it writes its adapter versions (EngineProcess's folder)


@dataclass(frozen=True)
class Generate:
    """One request: n completions of each prompt, by the weights of `version` (staged in the buffer)."""
    step: int                       # the training step it is for (-1: evaluation)
    version: int                    # optimizer steps behind the weights it must generate with
    entries: Layout                 # the staging buffer's layout
    prompt_ids: list[list[int]]
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seeds: Tensor | None            # (len(prompt_ids)·n,) int64, None for greedy
    check: bool = False             # answer the row sums of the weights it computes with (the sync check)


@dataclass(frozen=True)
class Stop:
    """The engine exits (0)."""


def send(sock: socket.socket, obj: object) -> None:
    """One message on a blocking socket (the engine's side; the spec, before the trainer's end turns non-blocking)."""
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(LENGTH.pack(len(data)))
    sock.sendall(data)


def recv(sock: socket.socket) -> object:
    """The next message on a blocking socket (the engine's side); EOFError when the trainer closed its end."""
    def exactly(n: int) -> bytearray:
        buf, got = bytearray(n), 0
        while got < n:
            k = sock.recv_into(memoryview(buf)[got:])
            if k == 0:
                raise EOFError
            got += k
        return buf
    return pickle.loads(exactly(LENGTH.unpack(exactly(LENGTH.size))[0]))


def engine_env(environ: Mapping[str, str], *, threads: int, extra: dict[str, str] | None) -> dict[str, str]:
    """An engine's environment: the trainer's less torchrun's variables, its thread count, no inductor compile
    workers (no grandchild to outlive it), vLLM's engine in its own process, unbuffered output, and `extra`
    (its CUDA_VISIBLE_DEVICES)."""
    kept = {k: v for k, v in environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    return {**kept, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", **(extra or {})}


class EngineProcess:
    """The trainer's handle on one engine process (rank 0 holds them)."""

    def __init__(self, spec: EngineSpec, index: int, staging_fd: int, env: dict[str, str] | None = None):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("engine processes start from the main thread (PR_SET_PDEATHSIG is per thread)")
        self.index = index
        # a vLLM engine's adapter versions (LoRA) go to a folder this process makes and removes (`kill`): the engine
        # ends with os._exit, or killed, and could remove nothing itself
        self.adapter_dir = tempfile.mkdtemp(prefix=ADAPTER_PREFIX) if spec.kind == "vllm" and spec.lora else ""
        spec = replace(spec, adapter_dir=self.adapter_dir)
        self.sock, child = socket.socketpair()
        # PR_SET_PDEATHSIG first, before the seconds of imports; then the trainer must still be its parent
        code = (f"import ctypes, os, signal; ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL); "
                f"os.getppid() == {os.getpid()} or os._exit(1); import sys; sys.path[:] = {sys.path!r}; "
                f"from pspo.engines.process import engine_main; engine_main({child.fileno()}, {staging_fd}); "
                "os._exit(0)")                  # no interpreter teardown (~1 s): nothing is left to flush
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child.fileno(), staging_fd),
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=engine_env(os.environ, threads=spec.threads, extra=env))
        child.close()
        self.pid, self.started = self.proc.pid, time.monotonic()
        send(self.sock, spec)                   # a few hundred bytes into an empty pipe: cannot block
        self.sock.setblocking(False)            # from now on every read and write waits under a deadline

    def name(self) -> str:
        return f"rollout.engines: engine {self.index} (pid {self.pid})"

    def send(self, msg: Generate | Stop, doing: str, deadline: Deadline) -> None:
        """`msg` written whole before `deadline`; EngineError (the engine killed) if it died or stopped reading.
        `doing`: what it is asked, for the error line."""
        data = pickle.dumps(msg, protocol=5)
        for part in (LENGTH.pack(len(data)), data):
            view = memoryview(part)
            while view:
                self._ready(select.POLLOUT, doing, deadline, "did not read its request")
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:                 # woken, yet the pipe is full again
                    continue
                except OSError:                         # its end is closed: it died
                    raise self._dead(doing) from None

    def wait_for(self, doing: str, deadline: Deadline) -> tuple:
        """The engine's next message, whole, before `deadline`; EngineError (the engine killed) if it died,
        failed or stayed silent. `doing`: what it was asked, for the error line."""
        n = LENGTH.unpack(self._read(LENGTH.size, doing, deadline, "did not answer"))[0]
        msg = pickle.loads(self._read(n, doing, deadline, "did not finish its answer"))
        if msg[0] == "error":
            self.kill()
            raise EngineError(f"{self.name()} failed while {doing}: {msg[1]}")
        return msg

    def _read(self, n: int, doing: str, deadline: Deadline, silent: str) -> bytearray:
        """Exactly n bytes of the pipe (those already there first: a past deadline does not drop an answer)."""
        buf, got = bytearray(n), 0
        while got < n:
            self._ready(select.POLLIN, doing, deadline, silent)
            try:
                k = self.sock.recv_into(memoryview(buf)[got:])
            except BlockingIOError:
                continue
            except OSError:
                raise self._dead(doing) from None
            if k == 0:                                  # EOF
                raise self._dead(doing)
            got += k
        return buf

    def _ready(self, event: int, doing: str, deadline: Deadline, silent: str) -> None:
        """Until the pipe is ready for `event` (select.POLLIN | POLLOUT; its closing counts), checking every
        WAIT_TICK_S that the engine lives: EngineError (it is killed) when it exits first or `deadline` passes.
        silent: what the engine did not do, for the error line."""
        poller = select.poll()
        poller.register(self.sock, event)
        while True:
            left = deadline.at - time.monotonic()
            if poller.poll(max(0.0, min(WAIT_TICK_S, left)) * 1e3):
                return
            if self.proc.poll() is not None:
                raise self._dead(doing)
            if time.monotonic() >= deadline.at:
                self.kill()
                raise EngineError(f"{self.name()} {silent} within {deadline.seconds:g} s while {doing} "
                                  "(rollout.engine_timeout_s); it was killed")

    def _dead(self, doing: str) -> EngineError:
        try:
            code = self.proc.wait(timeout=WAIT_TICK_S)
        except subprocess.TimeoutExpired:           # EOF, yet not exited: it closed its pipe
            code = None
        self.kill()
        how = ("closed its pipe" if code is None else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        return EngineError(f"{self.name()} {how} while {doing}")

    def kill(self) -> None:
        """SIGKILL to the engine's process group (its children too), then reap it and remove its adapter folder;
        idempotent. Only while it is not reaped: its pid (its group's id) is then still its own, never another
        process's."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self.sock.close()
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)


def stop_all(engines: list[EngineProcess]) -> None:
    """Ask every engine to exit (Stop), then kill those still running STOP_GRACE_S later: one grace for all, so
    that hung engines delay the end by STOP_GRACE_S, not by STOP_GRACE_S each. Idempotent."""
    grace = Deadline.after(STOP_GRACE_S)
    for e in engines:
        if e.proc.poll() is None:
            try:
                e.send(Stop(), "stopping", grace)
            except EngineError:                     # dead, or not reading: killed already
                pass
    for e in engines:
        try:
            e.proc.wait(timeout=max(0.0, grace.at - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        e.kill()


# ---- the engine's side ----------------------------------------------------------------------

def engine_main(fd: int, staging_fd: int) -> None:
    """An engine process's life (module docstring): the spec, "ready", then requests until Stop or EOF.
    Its start line (EngineProcess) has set PR_SET_PDEATHSIG already."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the trainer decides when the engine ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = socket.socket(fileno=fd)                 # blocking: the trainer's end holds the deadlines
    start = time.perf_counter()
    try:
        spec = recv(conn)
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)
        server = (_VLLMServer if spec.kind == "vllm" else _HFServer)(spec, mmap.mmap(staging_fd, 0))
        send(conn, ("ready", os.getpid(), time.perf_counter() - start))
        answered = time.perf_counter()
        while True:
            try:
                msg = recv(conn)
            except EOFError:                        # the trainer closed the pipe, or died
                return
            if isinstance(msg, Stop):
                return
            idle = time.perf_counter() - answered
            if msg.version != server.version or msg.check:
                load_s = server.load(msg.entries, msg.version) if msg.version != server.version else 0.0
                send(conn, ("loaded", msg.version, load_s, server.row_sums(msg.entries) if msg.check else None))
            t = time.perf_counter()
            rollout = server.engine.generate(msg.prompt_ids, msg.n, msg.temperature, msg.top_p,
                                             msg.max_new_tokens, msg.seeds)
            send(conn, ("rollout", msg.step, msg.version, rollout, time.perf_counter() - t, idle))
            answered = time.perf_counter()
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 - the trainer gets the line, the engine ends
        try:
            send(conn, ("error", error_line(e)))
        except OSError:
            pass
        os._exit(1)


class _HFServer:
    """kind "hf": a copy of the policy in this process, generating with engines/hf_engine.py."""

    def __init__(self, spec: EngineSpec, buffer: mmap.mmap):
        from pspo.engines.hf_engine import HFEngine
        from pspo.training.model import build_policy, load_tokenizer
        if spec.kind != "hf":
            raise ValueError(f"engine kind: expected hf, got {spec.kind!r}")
        policy = build_policy(spec.model_path, trust_remote_code=spec.trust_remote_code, chunk_tokens=2048,
                              bf16=spec.bf16, trainable=spec.lora is not None, lora=spec.lora)   # adapters: so built
        policy.requires_grad_(False)
        policy.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))   # its GPU (CUDA_VISIBLE_DEVICES)
        self.params = dict(policy.lm.named_parameters())                # a tied head: the embedding's, once
        tokenizer = load_tokenizer(spec.model_path, spec.trust_remote_code)
        self.engine = HFEngine(policy, tokenizer, spec.batch_size, compile=spec.compile, max_len=spec.max_len)
        self.flat = torch.frombuffer(buffer, dtype=torch.uint8)
        self.version: int | None = None

    @torch.no_grad()
    def load(self, entries: Layout, version: int) -> float:
        start = time.perf_counter()
        for name, tensor in views(self.flat, entries):
            if name not in self.params:
                raise KeyError(f"the staged weight {name} is not a parameter of the engine's model")
            self.params[name].copy_(tensor)
        self.version = version
        return time.perf_counter() - start

    def row_sums(self, entries: Layout) -> dict[str, Tensor]:
        return {e.name: row_sums(self.params[e.name].to(e.dtype)) for e in entries if e.name in self.params}


class _VLLMServer:
    """kind "vllm": a vLLM engine in this process (engines/vllm_engine.py), built from the base model; full weights
    are reloaded in place from the buffer's views, an adapter is written from them as a new version and served."""

    def __init__(self, spec: EngineSpec, buffer: mmap.mmap):
        from pspo.engines.vllm_engine import VLLMEngine
        from pspo.training.model import load_tokenizer
        self.lora = spec.lora
        self.engine = VLLMEngine(spec.model_path, load_tokenizer(spec.model_path, spec.trust_remote_code),
                                 max_model_len=spec.max_len, seed=spec.seed, bf16=spec.bf16,
                                 gpu_memory_utilization=spec.gpu_memory_utilization,
                                 lora_rank=spec.lora.rank if spec.lora else 0, lora_dir=spec.adapter_dir)
        self.flat = torch.frombuffer(buffer, dtype=torch.uint8)
        self.version: int | None = None

    def load(self, entries: Layout, version: int) -> float:
        from pspo.training.lora import write_adapter
        start = time.perf_counter()
        if self.lora is not None:
            self.engine.serve_adapter(lambda folder: write_adapter(folder, self.lora, views(self.flat, entries)))
        else:
            self.engine.load_weights(views(self.flat, entries))
        self.version = version
        return time.perf_counter() - start

    def row_sums(self, entries: Layout) -> dict[str, Tensor]:
        """Of what it computes with, under the trainer's names: the weights vLLM holds (the sync check's
        _engine_row_sums), or the adapter version it serves (its file, as the in-process check reads it)."""
        from pspo.engines.vllm_engine import _engine_row_sums, engine_rows
        if self.lora is not None:
            served = self.engine.served_adapter() or {}
            keys = {e.name: peft_key(e.name) for e in entries}
            return {name: row_sums(served[key]) if key in served else torch.zeros(0, dtype=torch.long)
                    for name, key in keys.items()}                 # one not served: all its rows differ
        packed, sums = self.engine.llm.collective_rpc(_engine_row_sums)[0]
        return engine_rows(packed, sums, [(e.name, e.shape) for e in entries])


def stale_rows(expected: dict[str, Tensor], engine: dict[str, Tensor]) -> tuple[int, int]:
    """(rows that differ, rows compared) between the row sums the trainer kept at staging and the engine's."""
    differ = compared = 0
    for name, ours in expected.items():
        theirs = engine.get(name)
        if theirs is None:                          # not held: vLLM's CPU backend's packed weights (engine_rows)
            continue
        differ += int((theirs != ours).sum()) if theirs.shape == ours.shape else len(ours)
        compared += len(ours)
    return differ, compared
