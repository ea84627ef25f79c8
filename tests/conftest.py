"""Shared fixtures. The tiny arithmetic model is built once (a short supervised warm-up, cached under
$PSPO_CACHE or ~/.cache/pspo) and shared by the tests and the demo. The K&K presets are rehearsed on
the untrained twin of the tiny K&K model (same tokenizer and architecture, built in seconds); the
trained K&K model (~20 minutes to build) is used only by the tests marked `knights_model`, which run
when it is already built or PSPO_BUILD_KNIGHTS=1 asks for the build (`scripts/study.sh --task knights`
does both), and are skipped with a reason otherwise.

End-to-end tests run train.py and eval.py in the test's own process through `run_main` (below):
about 5 s less per run than a fresh interpreter, which re-imports torch and transformers. What
needs a process of its own stays a subprocess: the torchrun launcher (the two-node test), a signal
sent to a run, a hard kill, a fresh interpreter's imports, vLLM (its state is per process), and
the exit code and stderr line of a user mistake (one test per way out of a script). Where many
commands need only their exit code and output, they fork from one interpreter that imported the
scripts once (`forked_commands`); two-rank checks of a function, and train.py's ranks as torchrun
would start them (`launch_train`), fork their ranks from the test's process (`forked_ranks`)."""
import contextlib
import dataclasses
import functools
import gc
import importlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Under pytest-xdist (scripts/test.sh runs `-n 2`), each worker and the train.py / torchrun processes
# it starts get the cores divided among the workers, here before anything imports torch: two
# workers of two PyTorch threads each on two cores made the preset rehearsals 2x slower than one
# process, two of one thread each 1.5x faster. The same share for inductor's compile workers (the
# compiled decoding step): with one, it compiles in the worker itself instead of starting a pool.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", _share)


# Each model is resolved once per test process (functools.cache) and handed to tests by a fixture.

@functools.cache
def _tiny_model() -> str:
    from pspo.offline.tiny import ensure_tiny_model
    return ensure_tiny_model()


@functools.cache
def _knights_standin() -> str:
    from pspo.offline.tiny_knights import knights_standin
    return knights_standin()


@functools.cache
def _tiny_knights_model() -> str:
    from pspo.offline.tiny_knights import ensure_tiny_knights_model
    return ensure_tiny_knights_model()


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    return _tiny_model()


@pytest.fixture(scope="module")
def knights_standin_path() -> str:
    return _knights_standin()


def _group_gone(pid: int) -> bool:
    """No live process `pid` (reaped, or a zombie), and none left that setsid put under it (sid = pid)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()         # state, ppid, pgrp, sid, ...
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (int(entry) == pid or int(fields[3]) == pid):
            return False
    return True


@pytest.fixture
def gone():
    """gone(pid): no live process pid, and none with sid pid (an engine process and what it started)."""
    return _group_gone


@pytest.fixture(scope="module")
def six_prompts(tmp_path_factory) -> str:
    """A 6-prompt train file (the first six built-in additions): with B = 4, prompts revisit within a few
    steps, so the sampler's and ERS's state matter."""
    import json
    from pspo.tasks.data import builtin_arithmetic
    path = tmp_path_factory.mktemp("data") / "six.jsonl"
    with open(path, "w") as f:
        for ex in builtin_arithmetic("train")[:6]:
            f.write(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny_knights_model_path() -> str:
    from pspo.offline.tiny_knights import tiny_knights_path
    if not os.path.isdir(tiny_knights_path()) and os.environ.get("PSPO_BUILD_KNIGHTS") != "1":
        pytest.skip("the trained tiny K&K model is not built (~20 min): `bash scripts/study.sh --task knights` "
                    "builds it and runs these tests (or set PSPO_BUILD_KNIGHTS=1)")
    return _tiny_knights_model()


# ---- train.py and eval.py in this process ----

@dataclasses.dataclass
class Ran:
    result: object          # what main returned (eval.py: its results; train.py: None)
    out: str                # what the run printed on stdout
    err: str                # ... and on stderr


# the signals a run may take over: PreemptionSignal's two, the reward guard's alarm, Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM, signal.SIGINT)


def _child_pids() -> set[int]:
    """The live processes whose parent is this one (Linux /proc; elsewhere: none seen)."""
    if not os.path.isdir("/proc"):
        return set()
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()     # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):
            continue                                            # not a process, or gone meanwhile
        if int(fields[1]) == os.getpid():
            pids.add(int(entry))
    return pids


def _clear_frames(error: BaseException | None) -> None:
    """Drop the locals of the finished frames an exception (and its causes) hold, so that what the
    run built (its reward pool's workers, its files) is collected now, not when pytest lets go of it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _run_main(script: str, *argv: str) -> Ran:
    """`script.main(argv)` (script: "train" or "eval") from the repository root, as `python
    script.py argv` would run it, printing into Ran.out/err (and echoing it, for pytest's report).
    A user mistake raises its exception: the message is the one line the script prints after
    "error: ". Afterwards the process is as it was before: the working directory, sys.argv, the
    environment, the signal handlers, torch's RNG, default dtype, thread count and grad mode, and
    Python's RNG; TensorBoard writers the run left open (a run stopped by an error) are closed;
    and no process group or child process (reward workers) may be left behind."""
    import torch
    import torch.distributed as dist
    from torch.utils.tensorboard import SummaryWriter
    module = importlib.import_module(script)         # import first: what importing sets, stays set
    main, resolve_workers = module.main, module.resolve_workers
    cwd, argv0, environ = os.getcwd(), list(sys.argv), dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    rng, py_rng = torch.get_rng_state(), random.getstate()
    dtype, threads, grad = torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled()
    children = _child_pids()
    grouped = dist.is_available() and dist.is_initialized()    # vLLM's own world of one, from an earlier test
    writers, writer_init = [], SummaryWriter.__init__

    def tracked_init(self, *args, **kwargs):
        writer_init(self, *args, **kwargs)
        writers.append(self)

    out, err, error, result = io.StringIO(), io.StringIO(), None, None
    SummaryWriter.__init__ = tracked_init
    # reward.workers -1 (auto) counts the cores this process may run on less its threads: 1 here, but the other
    # pytest-xdist worker holds the second core, so auto scores in the trainer (0 workers) as on a 1-core machine.
    # Starting a worker process took about half of a preset rehearsal; tests of the pool set reward.workers.
    module.resolve_workers = lambda workers, threads: 0 if workers == -1 else resolve_workers(workers, threads)
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = main(list(argv))
    except BaseException as e:                       # a user mistake, a test's failure, a bug: re-raised below
        error = e
        _clear_frames(e)
    SummaryWriter.__init__ = writer_init
    module.resolve_workers = resolve_workers
    for writer in writers:
        writer.close()                               # idempotent: a finished run closed its own
    os.chdir(cwd)
    sys.argv[:] = argv0
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.set_rng_state(rng)
    random.setstate(py_rng)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    left = _child_pids() - children
    if left and error is not None:                   # its reward pool's workers: a finished run closed its own,
        gc.collect()                                 # a failed one's closes when collected (a collection takes
        left = _child_pids() - children              # ~0.3 s: not after every run, nor every error)
    new_group = not grouped and dist.is_available() and dist.is_initialized()
    if new_group:
        dist.destroy_process_group()
    if left or new_group:
        raise AssertionError(f"{script}.main left behind: {'a process group ' if new_group else ''}"
                             f"{f'child processes {sorted(left)}' if left else ''}") from error
    if error is not None:
        raise error
    return Ran(result, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def run_main():
    """`run_main("train", "--config", ...)`: train.py (or "eval": eval.py) in this process; see
    _run_main. Module-scoped, so that a module's fixture may share one run among its tests."""
    return _run_main


# ---- commands forked from one interpreter ----

def folder_digest(path: str) -> str:
    """sha256 of every file (relative path and bytes) and every folder under `path`: what a refused run
    must leave as it was."""
    import hashlib
    digest = hashlib.sha256()
    for root, subdirs, names in sorted(os.walk(path)):
        for name in sorted(subdirs) + sorted(names):
            full = os.path.join(root, name)
            digest.update(os.path.relpath(full, path).encode() + b"\0")
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def run_commands(commands_file: str, results_file: str, watch: str = "", imports: str = "") -> None:
    """Each command of `commands_file` (JSON: [program, argv] pairs) in a process of its own, from the
    repository root, as `python train.py argv` (program "train"), `python eval.py argv` ("eval") or
    `python -c program argv` (any other program: Python code) would run it: forked from this process,
    which imported the scripts (and datasets, and the comma-separated modules `imports`) once, with its
    stdout and stderr in files. `results_file` gets each one's exit code, stdout and stderr, and, with
    `watch`, folder_digest(watch) after it. Run in an interpreter of its own (forked_commands)."""
    import runpy
    import tempfile
    import datasets  # noqa: F401 - what reading a data file imports, once
    for module in ("train", "eval", *filter(None, imports.split(","))):
        importlib.import_module(module)
    with open(commands_file) as f:
        commands = json.load(f)
    results = []
    for program, argv in commands:
        out, err = (tempfile.TemporaryFile() for _ in range(2))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                               # the command, as python would run it
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            script = program in ("train", "eval")
            sys.argv = [f"{program}.py" if script else "-c", *argv]
            code = 0
            try:
                if script:
                    runpy.run_path(f"{program}.py", run_name="__main__")
                else:
                    exec(compile(program, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except BaseException:                                  # noqa: BLE001 - a traceback, as python shows it
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        streams = []
        for stream in (out, err):
            stream.seek(0)
            streams.append(stream.read().decode(errors="replace"))
        results.append({"exit": os.waitstatus_to_exitcode(status), "stdout": streams[0], "stderr": streams[1],
                        **({"watched": folder_digest(watch)} if watch else {})})
    with open(results_file, "w") as f:
        json.dump(results, f)


def _forked_commands(commands: list, folder: str, env: dict | None = None, watch: str = "",
                     imports: tuple[str, ...] = ()) -> list[dict]:
    """run_commands on these [program, argv] pairs in a fresh interpreter (its files in `folder`), which
    must exit 0: [{"exit", "stdout", "stderr"(, "watched")}], one per command. A command pays its own
    work, not the ~7 s of importing torch and transformers a `python train.py` pays (nor, for the modules
    in `imports`, theirs: vLLM's ~1.5 s)."""
    commands_file, results_file = os.path.join(folder, "commands.json"), os.path.join(folder, "results.json")
    with open(commands_file, "w") as f:
        json.dump(commands, f)
    driver = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
              "import conftest; conftest.run_commands(*sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", driver, commands_file, results_file, watch, ",".join(imports)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(results_file) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def forked_commands():
    """`forked_commands(commands, folder, env=None, watch="", imports=())`: see _forked_commands."""
    return _forked_commands


def _train_rank(rank: int, nproc: int, port: int, args: list[str]) -> None:
    """Rank `rank` of `torchrun --standalone --nproc_per_node=nproc train.py args`: torchrun's environment for
    it, then train.py as `python train.py` runs it, which ends the rank (a rank of a group: os._exit with its
    exit code, distributed.finish)."""
    import runpy
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(ROOT)
    sys.argv = ["train.py", *args]
    runpy.run_path("train.py", run_name="__main__")


def _launch_train(args: list[str], nproc: int = 1):
    """train.py with these arguments: in this process (`_run_main`; a user mistake raises its error) or,
    nproc > 1, as torchrun's nproc ranks on one node, which must all exit 0 within 600 s. The ranks are forked
    from this process (`_forked_ranks`), which imported train.py once: a torchrun rank's fresh interpreter
    spends ~5 s importing it (tests/e2e/test_loop.py's two-node test runs the real launcher)."""
    if nproc == 1:
        return _run_main("train", *args)
    import socket
    with socket.socket() as s:                            # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _forked_ranks(_train_rank, (nproc, port, list(args)), nprocs=nproc, timeout=600)


@pytest.fixture(scope="module")
def launch_train():
    """`launch_train(args, nproc=1)`: train.py in this process, or as torchrun's nproc ranks (forked)."""
    return _launch_train


def _one_thread(rank: int, fn, *args) -> None:
    """A forked rank: one PyTorch thread, as torchrun gives each rank (OMP_NUM_THREADS=1), before anything
    runs; a fork does not copy this process's OpenMP threads, and a parallel region over more than one
    would wait on them forever."""
    import torch
    torch.set_num_threads(1)
    fn(rank, *args)


def _forked_ranks(fn, args: tuple, nprocs: int = 2, timeout: float = 600) -> None:
    """fn(rank, *args) on nprocs ranks as torch.multiprocessing.spawn runs them (a rank's error or exit code
    other than 0 is raised here; ranks still running after `timeout` seconds are killed, a failure), in
    processes forked from this one: a rank starts with this process's imports instead of a fresh
    interpreter's (torch, transformers, the test module: ~5 s a rank). Spawned where this process holds a
    process group (vLLM's world of one, from an earlier test), which a forked rank would inherit."""
    import time
    import torch.distributed as dist
    import torch.multiprocessing as mp
    if dist.is_available() and dist.is_initialized():
        ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    else:
        ranks = mp.start_processes(_one_thread, args=(fn, *args), nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise AssertionError(f"{fn.__name__}: ranks still running after {timeout:g} s, killed")


@pytest.fixture(scope="session")
def forked_ranks():
    """`forked_ranks(fn, args, nprocs=2, timeout=600)`: fn(rank, *args) on nprocs forked ranks (see _forked_ranks)."""
    return _forked_ranks


@pytest.fixture
def hub_offline(monkeypatch):
    """The Hugging Face hub in offline mode for an in-process run, as HF_HUB_OFFLINE=1 makes it for a
    new process: a name the test forgot to map to a local copy fails at once instead of downloading.
    huggingface_hub and datasets read the variable once, at import, hence their flags too."""
    import datasets.config
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


# module fixtures holding one run that several tests read: their tests go to one worker, so it runs once
SHARED_RUNS = ("pspo_3_steps", "with_hf", "uninterrupted", "sampler_run", "commands", "refused", "plan_commands",
               "with_the_builder", "four_steps", "full_run", "built", "real_width_models", "quick")


def pytest_collection_finish(session):
    """Under pytest-xdist a test's group must reach the scheduler in its node id ("...@vllm"); a pytest whose
    node ids drop it would run every shared run and engine once per worker: refused, saying why."""
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost and os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        raise pytest.UsageError(f"pytest {pytest.__version__} drops pytest-xdist's groups from the node ids "
                                f"({lost[0]}): install the pytest requirements.txt pins")


@pytest.hookimpl(tryfirst=True)             # before pytest-xdist writes the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """The slow tests first, so that under pytest-xdist no worker is left with a long one at the
    end; the tests sharing one vLLM engine or one run (a module fixture) on one worker (--dist
    loadgroup). First of the plugins' hooks: xdist's (in each worker) turns the group marks into the
    test ids its scheduler groups by, and sees only the marks made before it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)      # stable: file order kept
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.path.name == "test_vllm_engine.py":
                item.add_marker(pytest.mark.xdist_group("vllm"))
            for name in SHARED_RUNS:
                if name in getattr(item, "fixturenames", ()):
                    item.add_marker(pytest.mark.xdist_group(name))


class LinearLogprobs:
    """A stand-in policy for the Single-stream PO tracker's tests: log π of a completion token t is -scale·t, so a
    change of scale by δ moves a completion's log-probs by δ·t per token (the drift D = δ · its mean token id).
    Called as the policy is by score_logprobs: (input_ids, attention_mask, width, temperature, ...) ->
    (log-probs (N, width), entropies)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, input_ids, attention_mask, width, temperature, packed_width=None, packed=None):
        import torch
        logp = -self.scale * input_ids[:, -width:].float()
        return logp, torch.zeros_like(logp)
