"""A run survives what clusters and numerics do to it: a preemption signal saves and exits 0 so
`--train.resume=auto` continues; non-finite updates are skipped and, three in a row, stop the run
with the weights untouched; a context the model cannot hold stops before any work, in one line; a
refused run (a model whose weights or tokenizer cannot load included) writes nothing to its folder and
prints nothing but its one line; the ranks of a finished run leave the process group
together. The preempted run is a subprocess (a signal to it); the refused commands are processes forked
from one interpreter (conftest's run_commands: their exit code and stderr); the others run in this
process (conftest's run_main)."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from pspo.training.config import load_config
from pspo.training.model import ModelError
from pspo.training.optim import lr_lambda
from conftest import folder_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--train.prompts_per_step=4", "--rollout.num_generations=4", "--train.micro_batch_size=16",
         "--train.progress=false", "--rollout.engine=hf"]


def arguments(out, model, *overrides):
    return ["--config", "configs/grpo.yaml", f"--train.output_dir={out}", f"--model.name_or_path={model}", *SMALL,
            *overrides]


def command(out, model, *overrides):
    return [sys.executable, "train.py", *arguments(out, model, *overrides)]


def logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_signal_saves_and_exits_0_then_resume_continues(tmp_path, tiny_model_path, run_main, sig):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(command(out, tiny_model_path, "--train.max_steps=200", "--data.eval="), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while len(logged_steps(out)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    last = logged_steps(out)[-1]
    assert 2 <= last < 200                                  # it finished the step it was in, then stopped
    assert f"{sig.name} received: stopped after step {last}" in stdout
    ckpt = os.path.join(out, f"checkpoint-{last}")
    assert torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True)["step"] == last
    if sig == signal.SIGTERM:                               # and the run continues from there
        # with a new learning rate: the config's lr applies at the restored step of the schedule
        # (the saved AdamW state must not bring back the old one)
        overrides = [f"--train.max_steps={last + 2}", "--data.eval=", "--optim.lr=5e-4"]
        resumed = run_main("train", *arguments(out, tiny_model_path, *overrides, "--train.resume=auto"))
        assert f"resumed from {ckpt} at step {last}" in resumed.out
        assert logged_steps(out) == list(range(1, last + 3))
        cfg = load_config("configs/grpo.yaml", SMALL + overrides)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lr = [json.loads(line)["lr"] for line in f][last]            # step last + 1
        assert lr == pytest.approx(5e-4 * lr_lambda(cfg)(last + 1), rel=1e-9)


@pytest.mark.slow
def test_a_run_whose_compiles_fail_trains_eagerly(tmp_path, tiny_model_path, run_main, monkeypatch):
    # Every compiled path on (the decoding step, the decoder layers, the log-prob head) and a compiler that
    # fails every compile (a backend that raises, as a compiler bug would; pspo/training/compiled.py): the
    # run trains its 2 steps and saves; each of the 4 compiled functions says so once on stderr, and step 1,
    # which holds every first call (step 0 has no evaluation here), logs the 4 fallbacks, step 2 none
    import torch._dynamo
    from pspo.training import model, token_logprobs

    def fresh():
        torch._dynamo.reset()
        model._compiled.cache_clear()
        token_logprobs._compiled.cache_clear()

    def broken_backend(gm, example_inputs):
        raise RuntimeError("C++ compile failed")
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, backend=broken_backend,
                                                                      dynamic=options.get("dynamic")))
    fresh()
    try:
        out = str(tmp_path / "run")
        ran = run_main("train", *arguments(out, tiny_model_path, "--train.max_steps=2", "--data.eval=",
                                           "--rollout.compile=always", "--train.compile=always",
                                           "--model.logprob_head=compiled"))
    finally:
        fresh()
    warned = [line.split(" (RuntimeError")[0] for line in ran.err.splitlines() if line.startswith("warning: torch")]
    assert sorted(warned) == ["warning: torch.compile failed for the decoder layers (Qwen2DecoderLayer.forward)",
                              "warning: torch.compile failed for the decoding step",
                              "warning: torch.compile failed for the log-prob head (_chunk_stats)",
                              "warning: torch.compile failed for the log-prob head (_grad_logits)"]
    assert "scoring: decoder layers compiled (train.compile=always), log-prob head compiled" in ran.out
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["compile_fallbacks"]) for r in rows] == [(1, 4), (2, 0)]
    assert os.path.isdir(os.path.join(out, "checkpoint-2"))


@pytest.mark.slow
def test_non_finite_updates_are_skipped_and_three_in_a_row_stop_the_run(tmp_path, tiny_model_path, run_main):
    # A model with one NaN in its final norm: every loss is NaN. Each update is skipped (the
    # weights and AdamW state untouched), logged, and the third in a row saves and stops with a
    # NonFiniteError (train.py: its one line, exit 2).
    import train
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_model_path):
        if name != "model.safetensors":
            os.symlink(os.path.join(tiny_model_path, name), broken / name)
    weights = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    out = str(tmp_path / "run")
    with pytest.raises(train.NonFiniteError) as e:
        run_main("train", *arguments(out, broken, "--train.max_steps=10", "--data.eval="))
    assert str(e.value).startswith("optim.lr: 3 updates in a row had a non-finite loss or gradient norm (steps 1-3)")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["skipped_steps"] for r in rows] == [1, 1, 1]
    saved = load_file(os.path.join(out, "checkpoint-3", "model.safetensors"))
    for name, tensor in weights.items():
        torch.testing.assert_close(saved[name], tensor, atol=0, rtol=0, equal_nan=True, msg=name)
    # AdamW's moments never saw a gradient (saving a full optimizer state initializes them at 0)
    optimizer = torch.load(os.path.join(out, "checkpoint-3", "optimizer.pt"), weights_only=True)
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in optimizer["state"].values())


@pytest.mark.slow
def test_a_context_the_model_cannot_hold_is_one_line(tmp_path, tiny_model_path, run_main, capsys):
    # the tiny model has 1024 positions: 1000 prompt + 100 new tokens do not fit: a ModelError before
    # anything is printed (train.py: its one line on stderr, exit 2)
    with pytest.raises(ModelError) as e:
        run_main("train", *arguments(str(tmp_path / "run"), tiny_model_path, "--data.max_prompt_tokens=1000",
                                     "--rollout.max_new_tokens=100"))
    printed = capsys.readouterr()
    assert printed.out.strip() == ""
    assert (printed.err + f"error: {e.value}").strip().splitlines() == [
        "error: data.max_prompt_tokens (1000) + rollout.max_new_tokens (100) = 1100 exceeds the model's "
        "max_position_embeddings (1024); lower one of them"]


# train.py's start-up on a GPU of 1 MiB: the real plan of the run, checked as on CUDA (on CPU it is
# printed, never enforced)
SMALL_GPU = """
import runpy, sys
from pspo.training import plan
def startup_check(cfg, model_path, world_size, device, engine, resolve):
    arch = plan.arch_from_config(plan.load_model_config(model_path))
    plan.check_fits(plan.make_plan(cfg, arch, gpus=world_size, gpu_bytes=2 ** 20, engine=engine, prm=None), cfg)
plan.startup_check = startup_check
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


SAME = "; resume with the same setting"
REFUSED = [
    # resumed under another method, another sampler, ERS the other way, another train set
    (["--train.resume=auto", "--algo.advantage=reinforce_pp", "--algo.beta=0"],
     "error: algo.advantage: the checkpoint was trained with algo.advantage=grpo, this run has "
     "algo.advantage=reinforce_pp" + SAME),
    (["--train.resume=auto", "--pps.enabled=true"],
     "error: pps.enabled: the checkpoint was trained with pps.enabled=false, this run has "
     "pps.enabled=true" + SAME),
    (["--train.resume=auto", "--ers.enabled=true"],
     "error: ers.enabled: the checkpoint was trained with ers.enabled=false, this run has "
     "ers.enabled=true" + SAME),
    (["--train.resume=auto", "--data.max_train_examples=6"],
     "error: checkpoint sampler has 8 prompts, the dataset has 6: resume with the same data.train"),
    # a checkpoint that is not one
    (["--train.resume=/nonexistent/checkpoint-1"],
     "error: train.resume: '/nonexistent/checkpoint-1' is not a checkpoint folder (no trainer_state.pt)"),
    # a fresh run into the used folder: a model path, a context, data, a sampler, a memory plan that cannot be
    (["--model.name_or_path=/nonexistent/model"],
     "error: model.name_or_path: cannot load a tokenizer from '/nonexistent/model' ("),
    # the tiny model's copies (bad_models): its weights cut at 100 kB of 3.5 MB, or 5 kB of random bytes; its
    # tokenizer.json not JSON. The weights load after the memory plan is made: its lines wait for them
    (["--model.name_or_path={models}/truncated"],
     "error: model.name_or_path: cannot load a causal LM from '{models}/truncated' (Error while deserializing "
     "header: incomplete metadata, file not fully covered)"),
    (["--model.name_or_path={models}/garbage"],
     "error: model.name_or_path: cannot load a causal LM from '{models}/garbage' (Error while deserializing "
     "header: header too large)"),
    (["--model.name_or_path={models}/bad_tokenizer"],
     "error: model.name_or_path: cannot load a tokenizer from '{models}/bad_tokenizer' (Expecting value: line 1 "
     "column 1 (char 0))"),
    (["--data.max_prompt_tokens=1000", "--rollout.max_new_tokens=100"],
     "error: data.max_prompt_tokens (1000) + rollout.max_new_tokens (100) = 1100 exceeds the model's "
     "max_position_embeddings (1024); lower one of them"),
    (["--data.train=/nonexistent/train.jsonl"], "error: /nonexistent/train.jsonl: file not found"),
    (["--pps.enabled=true", "--train.prompts_per_step=12"],
     "error: train.prompts_per_step: PPS draws 12 prompts per step (distinct), builtin:arithmetic has 8"),
    (["SMALL_GPU"], "error: memory plan per GPU (1 x 0.0 GiB, checkpointing auto -> full): "),
    # adapters on a module the model does not have (resumes under other LoRA settings: test_lora_loop.py)
    (["--model.lora.rank=4", "--model.lora.target_modules=foo_proj"], "error: model.lora.target_modules: "),
]


def bad_models(tiny_model_path: str, folder) -> None:
    """Copies of the tiny model in `folder` that cannot load: truncated/ (model.safetensors cut at 100 kB),
    garbage/ (5 kB of random bytes for it), bad_tokenizer/ (tokenizer.json not JSON)."""
    for name in ("truncated", "garbage", "bad_tokenizer"):
        shutil.copytree(tiny_model_path, folder / name)
    with open(folder / "truncated" / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    (folder / "garbage" / "model.safetensors").write_bytes(random.Random(0).randbytes(5000))
    (folder / "bad_tokenizer" / "tokenizer.json").write_text("not json\n")


@pytest.fixture(scope="module")
def refused(tmp_path_factory, tiny_model_path, run_main, forked_commands):
    """A finished one-step GRPO run on 8 train prompts (config.yaml, metrics.jsonl, tb/, checkpoint-1), then
    each REFUSED command into its folder as `python train.py ...` (conftest's run_commands: a process of its
    own, forked from one interpreter that imported train.py), the folder's digest taken after each, and a
    fresh run refused into a new folder: (the folder's digest before, the results, the fresh run's folder,
    the bad models' folder)."""
    tmp = tmp_path_factory.mktemp("refused")
    out, fresh, models = str(tmp / "run"), str(tmp / "fresh"), tmp / "models"
    models.mkdir()
    bad_models(tiny_model_path, models)
    run_main("train", *arguments(out, tiny_model_path, "--train.max_steps=1", "--data.eval=",
                                 "--data.max_train_examples=8"))
    before = folder_digest(out)
    commands = [[SMALL_GPU if overrides == ["SMALL_GPU"] else "train",
                 arguments(out, tiny_model_path, "--data.eval=", "--data.max_train_examples=8",
                           *[o.format(models=models) for o in overrides if o != "SMALL_GPU"])]
                for overrides, _ in REFUSED]
    results = forked_commands([*commands, ["train", arguments(fresh, "/nonexistent/model")]], str(tmp), watch=out)
    return before, results, fresh, models


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[" ".join(o) for o, _ in REFUSED])
def test_a_refused_run_writes_nothing(refused, case):
    # Every check that can refuse a run comes before its first write: the folder's files stay byte for
    # byte as the finished run left them (config.yaml included), with the refusal's one line and exit 2.
    before, results, _, models = refused
    r = results[case]
    lines = r["stderr"].strip().splitlines()
    assert r["exit"] == 2 and lines[-1].startswith(REFUSED[case][1].format(models=models)), r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"]
    assert r["watched"] == before


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[" ".join(o) for o, _ in REFUSED])
def test_a_refused_run_prints_only_its_line(refused, case):
    # Every check that can refuse a run, loads included (the weights, the tokenizer, the checkpoint resumed),
    # comes before the start-up lines (the memory plan, the micro-batches, the compiled paths): nothing on
    # stdout, the refusal alone on stderr
    _, results, _, _ = refused
    r = results[case]
    assert (r["stdout"], len(r["stderr"].strip().splitlines())) == ("", 1), r


@pytest.mark.slow
def test_a_refused_fresh_run_creates_no_folder(refused):
    _, results, fresh, _ = refused
    r = results[-1]
    assert r["exit"] == 2 and r["stderr"].strip().splitlines()[-1].startswith(
        "error: model.name_or_path: cannot load a tokenizer from '/nonexistent/model'")
    assert not os.path.exists(fresh)


@pytest.mark.parametrize("clean, calls", [(True, ["barrier", "destroy"]), (False, ["destroy"])])
def test_shutdown_waits_for_the_other_ranks_only_after_a_clean_finish(monkeypatch, clean, calls):
    """A finished run leaves the group together (a barrier, then destroy), so no rank closes its
    connections under a peer; after an error it must not wait for ranks that may never arrive."""
    from pspo.training import distributed
    seen = []
    monkeypatch.setattr(distributed, "_OWN_GROUP", True)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: seen.append("destroy"))
    distributed.shutdown(clean)
    assert seen == calls


@pytest.mark.parametrize("owned", [True, False])
def test_finish_ends_a_rank_without_finalization_only_when_it_owned_a_group(monkeypatch, owned):
    """train.py ends through distributed.finish: a rank of a process group leaves it together with
    its peers and exits with os._exit (the collective library's threads are not torn down by the
    interpreter's finalization); a world of one exits normally with the same code."""
    from pspo.training import distributed
    seen = []
    monkeypatch.setattr(distributed, "_OWN_GROUP", owned)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: owned)
    monkeypatch.setattr(distributed.dist, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: seen.append("destroy"))

    def fake_exit(code):
        seen.append(f"_exit {code}")
        raise SystemExit(code)
    monkeypatch.setattr(distributed.os, "_exit", fake_exit)
    with pytest.raises(SystemExit) as stop:
        distributed.finish(2, clean=False)
    assert stop.value.code == 2
    assert seen == (["destroy", "_exit 2"] if owned else [])
