"""How the trainer's waits on its engine processes end (engines/process.py "Deadlines", engines/schedule.py
"Faults"): a request to an engine that does not read, and an answer cut in the middle, end at the deadline in
one line with no process left; one deadline covers a whole wait, every engine and message in it; and an error of
rank 0, an engine's or a bug, ends the other rank waiting for it with the same line.

The engines are stand-ins: plain Python on the real trainer side of the pipe (`standin`), that write given bytes
at given times (time.monotonic is one clock for every process on Linux), so that each test takes about its
deadline. Their timings are scheduled from a start a little ahead (LEAD_S), once they run."""
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from pspo.engines.process import LENGTH, Deadline, EngineError, EngineProcess, Generate
from pspo.engines.schedule import EngineRollouts, Sampling
from pspo.training.config import error_line
from pspo.training.tokens import Rollout

LEAD_S = 0.25            # from the stand-ins' start to the first scheduled time: their interpreters are up by then
STANDIN = """
import os, socket, sys, time
sock = socket.socket(fileno={fd})
for at, data in {writes!r}:
    time.sleep(max(0.0, at - time.monotonic()))
    sock.sendall(data)
{then}
"""
SILENT = "time.sleep(60)"                   # reads nothing more, answers nothing more
STOPS = "sock.recv(1)"                      # exits on the first byte of the next request (Stop)


def standin(index: int, writes: list[tuple[float, bytes]], then: str = SILENT) -> EngineProcess:
    """An EngineProcess whose process writes each (time.monotonic(), bytes) of `writes`, then runs `then`
    (Python): the trainer's side (its non-blocking end of the pipe, send, wait_for, kill) is the real one."""
    e = object.__new__(EngineProcess)
    e.index, e.adapter_dir = index, ""
    e.sock, child = socket.socketpair()
    code = STANDIN.format(fd=child.fileno(), writes=writes, then=then)
    e.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child.fileno(),), start_new_session=True)
    child.close()
    e.pid, e.started = e.proc.pid, time.monotonic()
    e.sock.setblocking(False)
    return e


def framed(msg: tuple) -> bytes:
    """A message as an engine writes it (engines/process.py: send)."""
    data = pickle.dumps(msg, protocol=5)
    return LENGTH.pack(len(data)) + data


def answer(step: int, version: int, texts: list[str]) -> tuple:
    """An engine's ("rollout", ...) of len(texts) completions, completion i of i + 1 tokens (ids 10·(i+1))."""
    N = len(texts)
    mask = (torch.arange(N)[None, :] <= torch.arange(N)[:, None]).float()             # (N, N) row i: i + 1 ones
    rollout = Rollout(10 * mask.long() * (torch.arange(N)[:, None] + 1), mask, -mask, torch.zeros(N, dtype=torch.bool),
                      texts, 0.1)
    return ("rollout", step, version, rollout, 0.1, 0.0)


def rollouts_with(engines: list[EngineProcess], timeout_s: float, rank: int = 0, world: int = 1) -> EngineRollouts:
    """An EngineRollouts at lag 1 with these engines (rank 0's), 2 prompts, G = 2, step 3 launched (θ_2)."""
    sampling = Sampling(seed=0, step_prompts=2, G=2, temperature=1.0, top_p=1.0, max_new_tokens=4)
    rollouts = EngineRollouts(specs=[], entries=[], policy=None, lora=False, train_ids=[[5, 6], [7, 8]],
                              sampling=sampling, count=lambda rollout: None, rank=rank, world=world, lag=1,
                              timeout_s=timeout_s, check_every=0)
    rollouts.engines.extend(engines)
    rollouts.launched_step, rollouts.indices = 3, torch.tensor([0, 1])
    return rollouts


def test_a_request_to_an_engine_that_does_not_read_ends_at_the_deadline(gone):
    # 16 MB of seeds: far more than the pipe holds (a socket pair buffers ~208 kB here), so the write blocks after
    # the first part; it ends at the 0.5 s deadline with one line, the engine killed
    engine = standin(0, [])
    request = Generate(step=3, version=2, entries=[], prompt_ids=[[5, 6]], n=1, temperature=1.0, top_p=1.0,
                       max_new_tokens=4, seeds=torch.zeros(2_000_000, dtype=torch.long))
    try:
        start = time.monotonic()
        with pytest.raises(EngineError) as e:
            engine.send(request, "generating step 3", Deadline.after(0.5, since=start))
        elapsed = time.monotonic() - start
    finally:
        engine.kill()
    assert str(e.value) == (f"rollout.engines: engine 0 (pid {engine.pid}) did not read its request within 0.5 s "
                            "while generating step 3 (rollout.engine_timeout_s); it was killed")
    assert 0.5 <= elapsed < 0.9 and gone(engine.pid), elapsed


def test_an_answer_cut_in_the_middle_ends_at_the_deadline(gone):
    # engine 0 writes its answer in two halves 0.2 s apart: read whole. Engine 1 writes half of its answer and
    # stalls: its reader, which has the length and part of the bytes, ends at the 0.5 s deadline with one line
    msg = framed(answer(3, 2, ["a", "b"]))
    half = len(msg) // 2
    t0 = time.monotonic() + LEAD_S
    whole = standin(0, [(t0, msg[:half]), (t0 + 0.2, msg[half:])])
    cut = standin(1, [(t0, msg[:half])])
    try:
        time.sleep(max(0.0, t0 - time.monotonic()))
        got = whole.wait_for("generating step 3", Deadline.after(0.5, since=t0))
        assert got[:3] == ("rollout", 3, 2) and got[3].texts == ["a", "b"]
        assert torch.equal(got[3].completion_ids, torch.tensor([[10, 0], [20, 20]]))
        with pytest.raises(EngineError) as e:
            cut.wait_for("generating step 3", Deadline.after(0.5, since=t0))
        elapsed = time.monotonic() - t0
    finally:
        whole.kill()
        cut.kill()
    assert str(e.value) == (f"rollout.engines: engine 1 (pid {cut.pid}) did not finish its answer within 0.5 s "
                            "while generating step 3 (rollout.engine_timeout_s); it was killed")
    assert 0.5 <= elapsed < 0.9 and gone(cut.pid), elapsed


T_S = 1.0                # the deadline of the shared-deadline cases


@pytest.mark.parametrize("case", ["in time", "two engines", "two messages"])
def test_one_deadline_covers_every_engine_and_message_of_a_wait(case, gone):
    # T = 1 s. "two engines": engine 0 answers after 0.6 T, engine 1 0.6 T later (1.2 T); "two messages": one
    # engine's ("loaded", ...) after 0.6 T, its answer 0.6 T later. No wait of its own exceeds T, but the step's
    # does: it ends at T (a deadline restarted per engine or per message would end it at 1.2 T, successfully).
    # "in time": the same engines answering after 0.3 T and 0.6 T hand over their rows (the stand-ins work)
    t0 = time.monotonic() + LEAD_S
    first, second = answer(3, 2, ["a0", "a1"]), answer(3, 2, ["b0", "b1"])
    writes = {"in time": [[(t0 + 0.3 * T_S, framed(first))], [(t0 + 0.6 * T_S, framed(second))]],
              "two engines": [[(t0 + 0.6 * T_S, framed(first))], [(t0 + 1.2 * T_S, framed(second))]],
              "two messages": [[(t0 + 0.6 * T_S, framed(("loaded", 2, 0.1, None))), (t0 + 1.2 * T_S, framed(first))]]}
    engines = [standin(i, w, then=STOPS) for i, w in enumerate(writes[case])]
    rollouts = rollouts_with(engines, timeout_s=T_S)
    try:
        time.sleep(max(0.0, t0 - time.monotonic()))
        if case == "in time":
            drawn = rollouts.take(3)
            assert time.monotonic() - t0 < T_S
            assert drawn.rollout.texts == ["a0", "a1", "b0", "b1"] and drawn.rows == [0, 0, 1, 1]
            assert torch.equal(drawn.rollout.completion_ids, torch.tensor([[10, 0], [20, 20], [10, 0], [20, 20]]))
            return
        with pytest.raises(EngineError) as e:
            rollouts.take(3)
        elapsed = time.monotonic() - t0
    finally:
        rollouts.close()
    late = engines[-1]
    assert str(e.value) == (f"rollout.engines: engine {late.index} (pid {late.pid}) did not answer within 1 s "
                            "while generating step 3 (rollout.engine_timeout_s); it was killed")
    assert T_S <= elapsed < T_S + 0.4, elapsed
    assert all(gone(engine.pid) for engine in engines)


def _take_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    """Two gloo ranks take step 3 twice; rank 0 fails each time, rank 1 waits for it at the schedule's collective:
    once as an engine's fault (its engine exits with code 3), once as a bug (an answer without its rows: KeyError).
    Each rank writes what it raised and when; a hang would end at the group's 60 s time-out."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    results = {}
    for case in ("fault", "bug"):
        engines = [standin(0, [], then="os._exit(3)")] if rank == 0 and case == "fault" else []
        rollouts = rollouts_with(engines, timeout_s=30.0, rank=rank, world=2)
        if rank == 0 and case == "bug":
            rollouts.answer = {"step": 3}
        start = time.monotonic()
        try:
            rollouts.take(3)
            results[case] = None
        except Exception as e:  # noqa: BLE001 - what each rank raised is the test's result
            results[case] = {"type": type(e).__name__, "str": str(e), "line": error_line(e),
                             "traceback": e.__traceback__ is not None, "s": time.monotonic() - start,
                             "pids": [engine.pid for engine in engines]}
        rollouts.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


def test_an_error_of_rank_0_ends_the_other_rank_with_the_same_line(tmp_path, forked_ranks, gone):
    forked_ranks(_take_on_rank, (str(tmp_path / "init"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # an engine's fault: the same EngineError line on both ranks (train.py: exit 2), the engine gone
    fault = [r["fault"] for r in ranks]
    pid = fault[0]["pids"][0]
    assert fault[0]["type"] == fault[1]["type"] == "EngineError"
    assert fault[0]["str"] == fault[1]["str"] == f"rollout.engines: engine 0 (pid {pid}) exited with code 3 " \
                                                 "while generating step 3"
    assert gone(pid)
    # a bug: rank 0 raises its own KeyError (train.py shows its traceback), rank 1 PeerError with its one line
    # (train.py: "error: rank 0 failed: KeyError: 'texts'", exit 1)
    bug = [r["bug"] for r in ranks]
    assert (bug[0]["type"], bug[0]["line"]) == ("KeyError", "KeyError: 'texts'")
    assert (bug[1]["type"], bug[1]["str"]) == ("PeerError", "KeyError: 'texts'")
    assert all(r["s"] < 5 for r in fault + bug), [r["s"] for r in fault + bug]     # no rank waited for a time-out


def test_train_ends_a_rank_whose_rank_0_failed_in_one_line_exit_1(monkeypatch, capsys):
    # train.py's way out for distributed.PeerError (raised here where the run would start): rank 0's line on
    # stderr, exit code 1, no traceback
    import runpy
    from pspo.training import distributed

    def rank_0_failed():
        raise distributed.PeerError("KeyError: 'texts'")
    monkeypatch.setattr(distributed, "init_distributed", rank_0_failed)
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", "configs/grpo.yaml"])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
    assert e.value.code == 1
    assert capsys.readouterr().err == "error: rank 0 failed: KeyError: 'texts'\n"
