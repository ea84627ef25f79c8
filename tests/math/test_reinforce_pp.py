"""REINFORCE++ and REINFORCE++-baseline, docs/related.md §A: the token reward,
return and global whitening with the hand-worked numbers of docs/related.md §A, an independent loop
implementation on random batches, whitening over 2 gloo ranks, the token-level loss seam and the
config checks. Their runs of the real loop: tests/e2e/test_methods_loop.py."""
import os

import pytest
import torch
import torch.distributed as dist

from pspo.training import distributed
from pspo.estimators import reinforce_pp_advantages, reinforce_pp_returns, whiten
from pspo.training.config import ConfigError, load_config
from pspo.training.distributed import Dist
from pspo.loss import policy_loss
from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.methods import Context, StepRollouts, group_baseline, method_for, score_first, training_batch
from pspo.training.model import build_policy, load_tokenizer
from pspo.training.optim import lr_lambda
from pspo.rewards import RewardResult
from pspo.engines.hf_engine import HFEngine
from pspo.engines.sampling import sequence_seeds
from pspo.training.micro_batches import token_rows
from pspo.update import policy_update

LOCAL = lambda x: x                  # noqa: E731  the sum over ranks in a world of one

# docs/related.md §A: one completion of 3 tokens, kl_coef .1, R = 1
OLD = torch.tensor([[-1.0, -2.0, -0.5]])                                   # logπ_old (1, 3)
REF = torch.tensor([[-1.5, -2.0, -1.0]])                                   # logπ_ref (1, 3)
ONE = torch.ones(1, 3, dtype=torch.bool)


# ---------------------------------------------------------------- hand-worked (docs/related.md §A)

def test_token_reward_and_return_hand_worked():
    # k1 = old - ref = [.5, 0, .5] -> -kl_coef·k1 = [-.05, 0, -.05]; R = 1 on the last token:
    # r = [-.05, 0, .95]; G_t = Σ_{t'≥t} r = [.90, .95, .95]
    G = reinforce_pp_returns(torch.tensor([1.0]), ONE, old_logp=OLD, ref_logp=REF, kl_coef=0.1, clip_score=10)
    torch.testing.assert_close(G, torch.tensor([[0.90, 0.95, 0.95]]), atol=1e-6, rtol=0)
    # R = 15 is clipped to 10 (only the score, not the KL): r = [-.05, 0, 9.95] -> G = [9.90, 9.95, 9.95];
    # R = -15 with no KL -> -10 on every token
    G = reinforce_pp_returns(torch.tensor([15.0]), ONE, old_logp=OLD, ref_logp=REF, kl_coef=0.1, clip_score=10)
    torch.testing.assert_close(G, torch.tensor([[9.90, 9.95, 9.95]]), atol=1e-5, rtol=0)
    G = reinforce_pp_returns(torch.tensor([-15.0]), ONE, old_logp=None, ref_logp=None, kl_coef=0.0, clip_score=10)
    torch.testing.assert_close(G, torch.full((1, 3), -10.0), atol=0, rtol=0)


@pytest.mark.parametrize("variance, expected", [
    # G = [.90, .95, .95]: mean .93333, deviations [-.03333, .01667, .01667], Σd² = .0016667
    ("bessel", [-1.1547, 0.5774, 0.5774]),       # var = Σd²/2 = .00083333, std .028868 (PaddleNLP)
    ("population", [-1.4142, 0.7071, 0.7071]),   # var = Σd²/3 = .00055556, std .023570 (OpenRLHF)
])
def test_whitened_advantages_hand_worked(variance, expected):
    A = reinforce_pp_advantages(torch.tensor([1.0]), ONE, old_logp=OLD, ref_logp=REF, kl_coef=0.1, clip_score=10,
                                variance=variance, reduce_sum=LOCAL)
    torch.testing.assert_close(A, torch.tensor([expected]), atol=1e-4, rtol=0)


def test_baseline_subtracts_the_group_mean_first():
    # two groups of 4 one-token completions: [1, 0, 0, 1] -> mean .5 -> [.5, -.5, -.5, .5];
    # [3, 3, 3, 3] -> 0. No KL: G = R - mean. Whitened over the 8 tokens: mean 0, Σd² = 4 * .25 = 1,
    # Bessel var 1/7 -> ±.5·sqrt(7) = ±1.32288; the flat group stays 0.
    rewards, mask = torch.tensor([1.0, 0, 0, 1, 3, 3, 3, 3]), torch.ones(8, 1)
    means = torch.tensor([0.5] * 4 + [3.0] * 4)                            # (8,) each completion's group mean
    G = reinforce_pp_returns(rewards, mask, old_logp=None, ref_logp=None, kl_coef=0.0, clip_score=10, baseline=means)
    torch.testing.assert_close(G[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]), atol=0, rtol=0)
    A = reinforce_pp_advantages(rewards, mask, old_logp=None, ref_logp=None, kl_coef=0.0, clip_score=10,
                                baseline=means, reduce_sum=LOCAL)
    torch.testing.assert_close(A[:, 0], torch.tensor([1.32288, -1.32288, -1.32288, 1.32288, 0, 0, 0, 0]),
                               atol=1e-4, rtol=0)
    # without the baseline the same rewards whiten around their mean 1.75 instead: a 3 stays positive
    A_plain = reinforce_pp_advantages(rewards, mask, old_logp=None, ref_logp=None, kl_coef=0.0, clip_score=10,
                                      reduce_sum=LOCAL)
    assert A_plain[4, 0] > 0 and A_plain[0, 0] < 0


def test_padding_is_zero_and_never_nan():
    # row 0: 2 valid tokens, R = 1; row 1: 1 valid token, R = 0. Padding holds -inf / +inf log-probs,
    # whose difference would be NaN. No KL on the valid tokens (old == ref there):
    # G = [[1, 1, 0], [0, 0, 0]]; the valid tokens hold [1, 1, 0]: mean 2/3, d = [1/3, 1/3, -2/3],
    # Σd² = 1/9 + 1/9 + 4/9 = 2/3, Bessel var 1/3 -> A = d·sqrt(3) = [.57735, .57735, -1.15470]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0, float("-inf")], [-2.0, float("inf"), float("-inf")]])
    ref = torch.tensor([[-1.0, -1.0, float("inf")], [-2.0, float("-inf"), float("inf")]])
    A = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, old_logp=old, ref_logp=ref, kl_coef=0.1,
                                clip_score=10, reduce_sum=LOCAL)
    torch.testing.assert_close(A, torch.tensor([[0.57735, 0.57735, 0], [-1.15470, 0, 0]]), atol=1e-4, rtol=0)


def test_token_level_advantages_in_the_clipped_surrogate():
    # docs/related.md §A: A = 1, ρ = 1.5, ε = (.2, .28) -> -min(1.5, 1.28) = -1.28 per token.
    # A token-level (1, 2) advantage [[1, -1]] with ρ = [1.5, .5]: the second token is
    # -min(-.5, -.8) = .8, so the sum is -.48; the PPS IS weight .5 scales both: -.24.
    logp, old = torch.tensor([[1.5, 0.5]]).log(), torch.zeros(1, 2)
    mask, w = torch.ones(1, 2), torch.ones(1)
    kw = dict(ref_logp=None, seq_weights=w, beta=0.0, eps_low=0.2, eps_high=0.28)
    loss, stats = policy_loss(logp[:, :1], old_logp=old[:, :1], advantages=torch.tensor([[1.0]]), mask=mask[:, :1],
                              **kw)
    assert loss.item() == pytest.approx(-1.28, abs=1e-6) and stats["clipped_tokens"].item() == 1
    loss, _ = policy_loss(logp, old_logp=old, advantages=torch.tensor([[1.0, -1.0]]), mask=mask, **kw)
    assert loss.item() == pytest.approx(-0.48, abs=1e-6)
    loss, _ = policy_loss(logp, old_logp=old, advantages=torch.tensor([[1.0, -1.0]]) * 0.5, mask=mask, **kw)
    assert loss.item() == pytest.approx(-0.24, abs=1e-6)
    # a (N,) advantage is the same as that value on every token: A = .7, ρ = [1.5, .5] ->
    # -min(1.05, .896) - min(.35, .56) = -.896 - .35 = -1.246
    per_seq, _ = policy_loss(logp, old_logp=old, advantages=torch.tensor([0.7]), mask=mask, **kw)
    per_tok, _ = policy_loss(logp, old_logp=old, advantages=torch.tensor([[0.7, 0.7]]), mask=mask, **kw)
    assert per_seq.item() == per_tok.item() == pytest.approx(-1.246, abs=1e-6)


# ---------------------------------------------------------------- against a direct loop

def loop_advantages(rewards, mask, old, ref, kl_coef, clip_score, group_size, variance):
    """PaddleNLP's per-position loop written out with Python floats: the independent reference."""
    N, T = mask.shape
    R = rewards.tolist()
    if group_size:
        for start in range(0, N, group_size):
            mean = sum(R[start:start + group_size]) / group_size
            for i in range(start, start + group_size):
                R[i] -= mean
    returns = [[0.0] * T for _ in range(N)]
    for i in range(N):
        valid = [t for t in range(T) if mask[i, t]]
        r = [0.0] * T
        for t in valid:
            r[t] = -kl_coef * (old[i, t].item() - ref[i, t].item())
        if valid:
            r[valid[-1]] += max(-clip_score, min(clip_score, R[i]))
        running = 0.0
        for t in reversed(range(T)):
            running = (r[t] + running) * float(mask[i, t])
            returns[i][t] = running
    values = [returns[i][t] for i in range(N) for t in range(T) if mask[i, t]]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - (variance == "bessel"))
    return torch.tensor([[(returns[i][t] - mean) / (var + 1e-8) ** 0.5 if mask[i, t] else 0.0 for t in range(T)]
                         for i in range(N)])


def random_batch(seed, N=12, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)                   # 1..T valid tokens each
    mask = torch.arange(T) < lengths[:, None]                              # (N, T) completions, right-padded
    rewards = torch.randn(N, generator=g) * 8                              # some beyond ±5
    old = -torch.rand(N, T, generator=g) * 3
    ref = old + torch.randn(N, T, generator=g)
    old, ref = old.masked_fill(~mask, float("-inf")), ref.masked_fill(~mask, float("inf"))   # padding garbage
    return rewards, mask, old, ref


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("variance", ["bessel", "population"])
def test_matches_a_direct_loop_on_random_batches(seed, group_size, variance):
    rewards, mask, old, ref = random_batch(seed)
    assert (rewards.abs() > 5).any()                                       # clip_score 5 is exercised
    baseline = rewards.view(-1, group_size).mean(1).repeat_interleave(group_size) if group_size else None   # (N,)
    got = reinforce_pp_advantages(rewards, mask, old_logp=old, ref_logp=ref, kl_coef=0.05, clip_score=5.0,
                                  baseline=baseline, variance=variance, reduce_sum=LOCAL)
    want = loop_advantages(rewards, mask, old, ref, 0.05, 5.0, group_size, variance)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[mask].std().item() > 0.5                                    # whitened, not trivially 0


# ---------------------------------------------------------------- global whitening over ranks

def _whiten_on_rank(rank, init_file, values, mask, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = slice(0, 5) if rank == 0 else slice(5, None)                    # unequal halves: 5 and 7 rows
    whitened = whiten(values[rows], mask[rows], "bessel", reduce_sum=distributed.all_reduce_sum)
    torch.save(whitened, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


def test_whitening_over_two_ranks_equals_one_process(tmp_path, forked_ranks):
    # in the fast command with the rest of tests/math/, although it starts two processes (forked: a second)
    rewards, mask, old, ref = random_batch(11)
    returns = reinforce_pp_returns(rewards, mask, old_logp=old, ref_logp=ref, kl_coef=0.05, clip_score=10.0)  # (12, 7)
    forked_ranks(_whiten_on_rank, (str(tmp_path / "init"), returns, mask, str(tmp_path)))
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)])
    want = whiten(returns, mask, "bessel", reduce_sum=LOCAL)               # one process, the whole batch
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    local = whiten(returns[:5], mask[:5], "bessel", reduce_sum=LOCAL)      # control: rank-local statistics differ
    assert (local - want[:5]).abs().max() > 1e-2


# ---------------------------------------------------------------- config

def test_config_requires_no_kl_loss_and_no_ers():
    base = ["--algo.advantage=reinforce_pp", "--algo.kl_coef=0.001"]
    cfg = load_config("configs/grpo.yaml", base + ["--algo.beta=0"])
    assert cfg.algo.needs_reference and cfg.algo.whiten == "bessel" and cfg.algo.clip_score == 10
    assert not load_config("configs/grpo.yaml", ["--algo.advantage=reinforce_pp"]).algo.needs_reference
    with pytest.raises(ConfigError, match=r"^algo.beta: expected 0 with algo.advantage=reinforce_pp .*KL is in the"):
        load_config("configs/grpo.yaml", base + ["--algo.beta=0.04"])
    # ERS smooths a group baseline: the baseline variant has one (R_i - m_q), plain REINFORCE++ none
    assert load_config("configs/grpo.yaml", ["--algo.advantage=reinforce_pp_baseline",
                                             "--ers.enabled=true"]).ers.enabled
    with pytest.raises(ConfigError, match=r"^ers.enabled: expected false with algo.advantage=reinforce_pp "):
        load_config("configs/grpo.yaml", ["--algo.advantage=reinforce_pp", "--ers.enabled=true"])
    with pytest.raises(ConfigError, match=r"^algo.kl_coef: expected 0 with algo.advantage=grpo"):
        load_config("configs/grpo.yaml", ["--algo.kl_coef=0.001"])
    with pytest.raises(ConfigError, match=r"^algo.whiten: expected bessel \| population, got 'std'"):
        load_config("configs/grpo.yaml", ["--algo.advantage=reinforce_pp", "--algo.whiten=std"])


# ---------------------------------------------------------------- the methods: π_old scored once

@pytest.mark.parametrize("overrides, scoring", [
    ([], 0),                                            # GRPO, one iteration: no extra forward pass (ρ ≡ 1)
    (["--algo.advantage=reinforce_pp", "--algo.kl_coef=0.001"], 3),            # π_old for the KL reward
    (["--algo.advantage=reinforce_pp", "--algo.kl_coef=0.001", "--algo.num_iterations=2"], 3),  # reused, not twice
    (["--algo.advantage=reinforce_pp_baseline"], 0),    # no KL: the rewards alone, ρ ≡ 1
])
def test_methods_score_pi_old_once_and_only_when_needed(tiny_model_path, overrides, scoring):
    cfg = load_config("configs/grpo.yaml", ["--train.micro_batch_size=4", "--rollout.num_generations=3",
                                            "--train.prompts_per_step=4", *overrides])
    tokenizer = load_tokenizer(tiny_model_path)
    examples = builtin_arithmetic("train")[:4]
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
           for ex in examples]
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    ref = build_policy(tiny_model_path, chunk_tokens=64, trainable=False) if cfg.algo.needs_reference else None
    seeds = sequence_seeds(0, 0, torch.arange(4), 3)                      # (12,)
    rollout = HFEngine(policy, tokenizer, 64).generate(ids, 3, 1.0, 1.0, 6, seeds)   # a real 12-sequence rollout
    rewards = torch.tensor([[1.0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])    # (4, 3)
    scored = RewardResult(rewards.reshape(-1), {"accuracy": rewards.reshape(-1), "format": torch.zeros(12)}, {})
    cpu = Dist(0, 1, torch.device("cpu"))
    method = method_for(cfg, ids, tokenizer.pad_token_id, cpu, False)
    ctx = Context(cfg=cfg, policy=policy, ref=ref, engine=None, train_ids=ids,
                  problems=[ex.problem for ex in examples], dist=cpu, mine=slice(0, 4), lockstep=False,
                  score=None, distinct_problems=4, state=method.state)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    calls = []
    policy.lm.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(module.training))
    rows = [i for i in range(4) for _ in range(3)]
    inputs = token_rows([ids[i] for i in rows], rollout.completion_ids, rollout.mask, tokenizer.pad_token_id,
                        cpu.device)
    rollouts = StepRollouts(step=0, indices=torch.arange(4), rows=rows, seeds=seeds, rollout=rollout,
                            scored=scored, rewards=rewards, is_weights=torch.ones(4, 3), inputs=inputs)
    rollouts.old_logp, rollouts.ref_logp = score_first(method, rollouts, ctx)      # the loop's calls around the method
    rollouts.baseline = group_baseline(method, rollouts, ctx)
    out = method.estimate(rollouts, ctx)
    batch, _ = training_batch(out, rollouts, ctx)
    policy_update(policy, optimizer, scheduler, batch, cfg, cpu)
    # 12 sequences in micro-batches of 4: 3 eval-mode scoring calls per scoring pass, then 3 per iteration
    assert calls == [False] * scoring + [True] * 3 * cfg.algo.num_iterations
    if cfg.algo.advantage != "grpo":                                      # token-level advantage stats
        n, sq = out.stats.advantages.adv_count, out.stats.advantages.adv_sq
        assert n == rollout.mask.sum() and sq / n == pytest.approx((n - 1) / n, rel=1e-4)
