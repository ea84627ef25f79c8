"""SPO in the real loop (pspo/related/spo.py, train.py) on the tiny model: the generation it pays for, the
advantages it hands the update, exact resume, two ranks, and its config errors.

A probe wraps the transformers engine's `generate` and the loop's `policy_update` around a run of
train.py in this process (conftest's run_main), recording every call, so the logged counts can be
checked against the engine calls themselves and the update's inputs against the rules of
docs/related.md §B. Two-rank runs are torchrun subprocesses.
"""
import math
import os
import shutil

import pytest
import torch

from pspo.training.config import ConfigError, load_config
from pspo.related.spo_segments import PROB_THRESHOLD, select_cuts, unique_prefixes
from test_loop import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--train.prompts_per_step=4", "--data.max_eval_examples=8", "--train.progress=false",
         "--train.micro_batch_size=64"]

@pytest.fixture
def probe(monkeypatch):
    """{"calls": [...], "updates": [...]}, filled by the runs of this test: every training call of the
    transformers engine's generate, and every policy_update's batch."""
    import train
    from pspo.engines import hf_engine
    calls, updates = [], []
    generate = hf_engine.HFEngine.generate

    def recorded(self, prompt_ids, n, temperature, top_p, max_new_tokens, seeds, prefix_ids=None):
        out = generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seeds, prefix_ids=prefix_ids)
        if seeds is not None:                     # evaluation is greedy (seeds None): not training's generation
            calls.append(dict(step=len(updates) + 1, prompts=prompt_ids, n=n, max_new_tokens=max_new_tokens,
                              prefixes=prefix_ids, ids=out.completion_ids, mask=out.mask, truncated=out.truncated))
        return out
    monkeypatch.setattr(hf_engine.HFEngine, "generate", recorded)
    update = train.policy_update

    def recorded_update(policy, optimizer, scheduler, batch, *args):
        updates.append(dict(input_ids=batch.input_ids, mask=batch.mask, token_advantages=batch.advantages,
                            loss_mask=batch.loss_mask, old_logp=batch.old_logp))
        return update(policy, optimizer, scheduler, batch, *args)
    monkeypatch.setattr(train, "policy_update", recorded_update)
    return {"calls": calls, "updates": updates}


@pytest.fixture(scope="module")
def train(launch_train, tiny_model_path):
    """train(out, config, *overrides, nproc=1): train.py on the tiny model, SMALL settings; one process
    runs in this one (a user mistake raises its error), nproc > 1 under torchrun (it must exit 0)."""
    def train(out, config, *overrides, nproc=1):
        return launch_train(["--config", config, f"--train.output_dir={out}",
                             f"--model.name_or_path={tiny_model_path}", *SMALL, *overrides], nproc)
    return train


def state(out, step):
    return torch.load(os.path.join(out, f"checkpoint-{step}", "trainer_state.pt"), weights_only=True)


def assert_token_accounting(rows, calls):
    """Each step's logged counts equal what the engine's training calls returned: fresh completions
    (no prefix) are rollout_tokens, continuations mc_tokens; generated_tokens is their running sum."""
    total = 0.0
    for r in rows[1:]:
        mine = [c for c in calls if c["step"] == r["step"]]
        fresh = [c for c in mine if c["prefixes"] is None]
        cont = [c for c in mine if c["prefixes"] is not None]
        assert r["rollout_calls"] == len(fresh) == 1 and r["mc_calls"] == len(cont) >= 1
        assert r["rollout_tokens"] == sum(float(c["mask"].sum()) for c in fresh)
        assert r["mc_tokens"] == sum(float(c["mask"].sum()) for c in cont) > 0
        total += r["rollout_tokens"] + r["mc_tokens"]
        assert r["generated_tokens"] == total
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0


def assert_spo_update_inputs(update):
    """docs/related.md §B, the probability mask and "Normalisation" (chain and tree): M = mask·1[p < 0.9]
    with p = exp(π_old); A is zero outside M, not everywhere inside it, and whitened over M (one rank:
    mean 0, Bessel std 1)."""
    A, M, old, mask = update["token_advantages"], update["loss_mask"], update["old_logp"], update["mask"]
    assert A.shape == M.shape == old.shape == mask.shape
    assert torch.equal(M, mask * (old.exp() < PROB_THRESHOLD))
    assert (A[M == 0] == 0).all() and (A[M == 1] != 0).any()
    kept = A[M == 1].double()
    assert abs(kept.mean().item()) < 1e-5 and kept.std().item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_chain_counts_its_continuations_and_masks_its_advantages(tmp_path, train, probe):
    out = str(tmp_path / "run")
    train(out, "configs/spo_chain.yaml", "--train.max_steps=2")
    rec, rows = probe, metrics(out)
    assert_token_accounting(rows, rec["calls"])
    for step, update in enumerate(rec["updates"], 1):
        assert_spo_update_inputs(update)
        # the continued states are exactly the distinct cut states of π_old's probabilities (K = 1), N = 4 each
        fresh, cont = [c for c in rec["calls"] if c["step"] == step and c["prefixes"] is None], \
            [c for c in rec["calls"] if c["step"] == step and c["prefixes"] is not None]
        rollout = fresh[0]
        prompts = [p for p in rollout["prompts"] for _ in range(rollout["n"])]
        cut_rows, cuts = select_cuts(update["old_logp"].exp(), rollout["mask"], 1)
        owners, prefixes, _ = unique_prefixes(prompts, rollout["ids"], cut_rows, cuts)
        assert len(cont) == 1 and cont[0]["n"] == 4 and cont[0]["prefixes"] == prefixes
        assert cont[0]["prompts"] == [prompts[o] for o in owners.tolist()]
        assert rows[step]["spo_cuts"] == len(cuts) > rows[step]["spo_states"] == len(prefixes)   # deduplicated


@pytest.mark.slow
def test_tree_grows_depth_by_depth_and_trains_edges(tmp_path, train, probe):
    out = str(tmp_path / "run")
    train(out, "configs/spo_tree.yaml", "--train.max_steps=2")
    rec, rows = probe, metrics(out)
    assert_token_accounting(rows, rec["calls"])
    for step in (1, 2):
        d0, d1, d2 = [c for c in rec["calls"] if c["step"] == step]          # branching 4,2,2; M = 3; L_max 12
        assert (d0["n"], d0["max_new_tokens"], len(d0["prompts"])) == (4, 3, 4) and d0["prefixes"] is None
        assert (d1["n"], d1["max_new_tokens"], d2["n"], d2["max_new_tokens"]) == (2, 6, 2, 12)
        # a node is continued exactly when it was cut at its budget (not finished): all of d0's truncated
        # rows, with their 3 tokens as the prefix; then d1's truncated rows with 3 + 3
        assert [p for p in d1["prefixes"]] == [d0["ids"][i, :3].tolist() for i in range(16) if d0["truncated"][i]]
        assert all(len(p) == 6 for p in d2["prefixes"]) and len(d2["prefixes"]) == int(d1["truncated"].sum())
        assert rows[step]["spo_nodes"] == 16 + len(d1["mask"]) + len(d2["mask"])
    for update in rec["updates"]:
        assert_spo_update_inputs(update)
    # step 1 draws at most 8 of each of the 4 questions' new edges (<= 28 per tree); the rest is replayed
    assert 0 < rows[1]["spo_edges"] <= min(rows[1]["spo_new_edges"], 8 * 4) and rows[1]["spo_expired"] == 0
    assert rows[1]["spo_buffer"] == rows[1]["spo_new_edges"] - rows[1]["spo_edges"]


@pytest.mark.slow
def test_tree_resumes_exactly_with_its_replay_buffer(tmp_path, train):
    # 4 steps with a checkpoint at 2 vs the same resumed from it: the replay buffer (edges, their
    # steps and π_old), the drawn edges and the count of generated tokens must all come back.
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    args = ["--train.max_steps=4", "--train.save_steps=2", "--spo.edges_per_question=3", "--spo.replay_iterations=2"]
    train(full, "configs/spo_tree.yaml", *args, "--train.keep_checkpoints=0")
    assert len(state(full, 2)["spo_tree"]["segment"]) > 0                  # edges left for later steps
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(full, "metrics.jsonl"), resumed)
    train(resumed, "configs/spo_tree.yaml", *args, "--train.resume=auto")
    a, b = metrics(full), metrics(resumed)
    assert a[4]["spo_expired"] > 0 or a[3]["spo_expired"] > 0              # replay_iterations 2 drops old edges
    for ra, rb in zip(a[3:5], b[3:5]):
        for key in ("generated_tokens", "mc_tokens", "spo_edges", "spo_buffer", "reward_mean", "loss", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), key
    sa, sb = state(full, 4), state(resumed, 4)
    assert sa["generated_tokens"] == sb["generated_tokens"] == a[4]["generated_tokens"]
    for key, value in sa["spo_tree"].items():
        other = sb["spo_tree"][key]
        for x, y in zip(value if isinstance(value, list) else [value], other if isinstance(other, list) else [other]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/spo_tree.yaml", "configs/spo_chain.yaml"])
def test_two_processes_match_one(tmp_path, train, config):
    # FSDP2 over 2 gloo ranks generating on the policy (lockstep: padded continuation calls), the
    # tree's buffer all-gathered and its edges dealt round-robin: the run must match 1 process.
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    args = ["--train.max_steps=2", "--train.micro_batch_size=8"] + \
        (["--spo.edges_per_question=3"] if "tree" in config else [])
    train(one, config, *args)
    train(two, config, *args, nproc=2)
    a, b = metrics(one), metrics(two)
    for ra, rb in zip(a[1:], b[1:]):
        for key in ("reward_mean", "loss", "grad_norm", "rollout_tokens", "spo_edges", "spo_buffer", "spo_states"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert b[2]["mc_tokens"] >= a[2]["mc_tokens"]                         # padding copies are generated too
    digests = [torch.load(os.path.join(two, "checkpoint-2", f"rng-rank{r}.pt"), weights_only=True)
               ["trainer_state_sha256"] for r in (0, 1)]
    assert digests[0] == digests[1]                                         # the buffer is replicated


@pytest.mark.parametrize("overrides, message", [
    (["--spo.num_mc=4"], "spo.num_mc: expected 9 (unset) unless algo.advantage=spo_chain, got 4"),
    (["--algo.advantage=spo_chain", "--spo.branching=4,4,4"], "spo.branching: expected '6,6,6' (unset) unless "
     "algo.advantage=spo_tree"),
    (["--algo.advantage=spo_tree"], "rollout.num_generations: expected spo.branching's b0 = 6"),
    (["--algo.advantage=spo_tree", "--rollout.num_generations=6"], "spo.segment_tokens: expected M0 + M1 < "
     "rollout.max_new_tokens = 12"),
    (["--algo.advantage=spo_tree", "--spo.branching=6,6", "--spo.segment_tokens=2"], "spo.branching: expected "
     "three positive integers"),
    (["--algo.advantage=spo_tree", "--rollout.num_generations=6", "--spo.segment_tokens=2,x"],
     "spo.segment_tokens: expected one positive integer M, or two M0,M1"),
    (["--algo.advantage=spo_tree", "--rollout.num_generations=6", "--spo.segment_tokens=2",
      "--pps.enabled=true"], "pps.enabled: expected false with algo.advantage=spo_tree"),
    (["--algo.advantage=spo_chain", "--ers.enabled=true"], "ers.enabled: expected false with algo.advantage=spo_chain"),
    (["--algo.advantage=spo_chain", "--algo.kl_coef=0.1"], "algo.kl_coef: expected 0 with algo.advantage=spo_chain"),
    (["--algo.advantage=spo_chain", "--spo.cutpoint_interval=0"], "spo.cutpoint_interval: expected >= 1"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs/grpo.yaml"), overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.slow
def test_presets_load_and_a_bad_key_is_one_line(tmp_path, train):
    tree = load_config(os.path.join(ROOT, "configs/spo_tree.yaml"))
    assert tree.spo.branch_factors == (4, 2, 2) and tree.spo.segments == (3, 3) and not tree.algo.needs_reference
    gpu = load_config(os.path.join(ROOT, "configs/qwen2.5-math-1.5b/spo_tree.yaml"))
    assert gpu.spo.branch_factors == (6, 6, 6) and gpu.spo.segments == (600, 600) and gpu.algo.beta == 1e-4
    with pytest.raises(ConfigError) as e:                                 # train.py: its one line, exit 2
        train(str(tmp_path / "x"), "configs/spo_tree.yaml", "--spo.segment_tokens=6")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("spo.segment_tokens: expected M0 + M1 < rollout.max_new_tokens = 12")
