"""Train/eval modes around the update, and gradient checkpointing that really recomputes.

transformers recomputes a checkpointed layer only when the module is in train mode, and in train
mode a checkpointed layer drops the KV cache, so `generate` must run in eval mode: the policy is
built in eval mode, `logprobs.score_policy` scores π_old / π_ref in eval mode, `policy_update` runs
the update in train mode and hands the policy back in eval mode. Checkpointing may change memory, never results.
"""
import copy

import torch

from pspo.training.config import load_config
from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.training.distributed import Dist
from pspo.methods import Context, StepRollouts, group_baseline, method_for, score_first, training_batch
from pspo.training.model import build_policy, load_tokenizer
from pspo.training.optim import lr_lambda
from pspo.rewards import RewardResult
from pspo.engines.hf_engine import HFEngine
from pspo.training.tokens import Rollout, batch_inputs
from pspo.engines.sampling import sequence_seeds
from pspo.training.micro_batches import token_rows
from pspo.update import policy_update

CPU = Dist(0, 1, torch.device("cpu"))
# (B, G) = (4, 3): distinct rewards in every group, so that every completion gets a non-zero advantage
REWARDS = torch.tensor([[1.0, 0.0, 0.4], [0.2, 1.0, 0.0], [0.0, 0.6, 1.0], [0.9, 0.3, 0.0]])


def rollout_batch(path, n_prompts=4, G=3):
    """A real rollout of the tiny model (6 new tokens): the tokenizer, the prompts' token ids, the
    Rollout (n_prompts·G completions, prompt-major) and its seeds."""
    tokenizer = load_tokenizer(path)
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
           for ex in builtin_arithmetic("train")[:n_prompts]]
    engine = HFEngine(build_policy(path, chunk_tokens=64), tokenizer, 64)
    seeds = sequence_seeds(0, 0, torch.arange(n_prompts), G)
    return tokenizer, ids, engine.generate(ids, G, 1.0, 1.0, 6, seeds), seeds


def _no_scoring(rows: list[int], texts: list[str]) -> RewardResult:
    raise AssertionError("only SPO scores continuations")


def method_update(policy, ref, optimizer, scheduler, batch, rewards, is_weights, cfg, dist_, mine=None):
    """One step as train.py runs it: the rollout with its (B, G) rewards and IS weights through the
    method algo.advantage names (methods.method_for) and the calls around it (score_first,
    group_baseline, training_batch), then policy_update on the batch.
    `mine`: this rank's prompts among the B (all of them by default), whose completions it trains."""
    tokenizer, ids, rollout, seeds = batch
    B, G = rewards.shape
    mine = mine or slice(0, B)
    local = slice(mine.start * G, mine.stop * G)                          # this rank's completions
    rollout = Rollout(rollout.completion_ids[local], rollout.mask[local], rollout.logprobs[local],
                      rollout.truncated[local], rollout.texts[local], rollout.gen_time_s)
    flat = rewards[mine].reshape(-1)                                       # (N,)
    scored = RewardResult(flat, {"accuracy": flat, "format": torch.zeros_like(flat)}, {"accuracy": 0})
    rows = [p for p in range(mine.start, mine.stop) for _ in range(G)]
    pad = tokenizer.pad_token_id
    inputs = token_rows([ids[i] for i in rows], rollout.completion_ids, rollout.mask, pad, dist_.device)
    rollouts = StepRollouts(step=0, indices=torch.arange(B), rows=rows, seeds=seeds[local], rollout=rollout,
                            scored=scored, rewards=rewards, is_weights=is_weights, inputs=inputs)
    problems = [f"p{i}" for i in range(B)]
    method = method_for(cfg, ids, pad, dist_, False)
    ctx = Context(cfg=cfg, policy=policy, ref=ref, engine=None, train_ids=ids, problems=problems, dist=dist_,
                  mine=mine, lockstep=False, score=_no_scoring, distinct_problems=B, state=method.state)
    rollouts.old_logp, rollouts.ref_logp = score_first(method, rollouts, ctx)
    rollouts.baseline = group_baseline(method, rollouts, ctx)
    batch, _ = training_batch(method.estimate(rollouts, ctx), rollouts, ctx)
    return policy_update(policy, optimizer, scheduler, batch, cfg, dist_)


def run_update(path, batch, checkpointing, overrides=()):
    """One GRPO step through methods.py (π_old / π_ref scored where the method needs them) and
    policy_update, with a decoder layer's forward calls recorded as (training, grad enabled)."""
    cfg = load_config("configs/grpo.yaml", ["--train.micro_batch_size=4", "--rollout.num_generations=3",
                                            *overrides])
    policy = build_policy(path, chunk_tokens=64, gradient_checkpointing=checkpointing)
    ref = build_policy(path, chunk_tokens=64, trainable=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    calls = []
    layer = policy.lm.model.layers[1]
    layer.register_forward_pre_hook(lambda module, args: calls.append((module.training, torch.is_grad_enabled())))
    assert not policy.training                                              # built in eval mode
    method_update(policy, ref, optimizer, scheduler, batch, REWARDS, torch.ones(4, 3), cfg, CPU)
    assert not policy.training and not ref.training                         # handed back in eval mode
    return policy, calls


def test_scoring_runs_in_eval_mode_and_the_update_in_train_mode(tiny_model_path):
    batch = rollout_batch(tiny_model_path)
    # 12 sequences, micro-batches of 4 -> 3 micro-batches; 2 iterations, so methods.grpo scores π_old
    # up front, before the update (π_ref runs on the reference model, whose layer is not hooked).
    _, calls = run_update(tiny_model_path, batch, False, ["--algo.num_iterations=2", "--algo.beta=0.04"])
    scoring, update = calls[:3], calls[3:]
    assert scoring == [(False, False)] * 3                                  # π_old: eval, no grad
    assert update == [(True, True)] * 6                                     # 2 iterations x 3 micro-batches


def test_checkpointing_recomputes_each_layer_and_changes_nothing(tiny_model_path):
    batch = rollout_batch(tiny_model_path)
    plain, calls_plain = run_update(tiny_model_path, batch, False)
    ckpt, calls_ckpt = run_update(tiny_model_path, batch, True)
    # Without checkpointing each micro-batch runs the layer once; with it, once more in backward
    # (the recompute, in train mode with grad enabled): 3 micro-batches -> 3 vs 6 calls.
    assert len(calls_plain) == 3 and len(calls_ckpt) == 6
    assert all(training for training, _ in calls_ckpt)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    base = build_policy(tiny_model_path, chunk_tokens=64)
    assert not torch.equal(base.lm.model.norm.weight, ckpt.lm.model.norm.weight)   # it did train


def test_generation_with_checkpointing_enabled_is_unchanged(tiny_model_path):
    # After an update the checkpointed policy is back in eval mode, where generate keeps its KV
    # cache: it must produce exactly what the same weights produce without checkpointing.
    tokenizer, ids, *_ = batch = rollout_batch(tiny_model_path)
    ckpt, _ = run_update(tiny_model_path, batch, True)
    plain = copy.deepcopy(ckpt)
    plain.lm.gradient_checkpointing_disable()
    seeds = sequence_seeds(1, 1, torch.arange(len(ids)), 2)
    a = HFEngine(ckpt, tokenizer, 64).generate(ids, 2, 1.0, 1.0, 8, seeds)
    b = HFEngine(plain, tokenizer, 64).generate(ids, 2, 1.0, 1.0, 8, seeds)
    assert a.texts == b.texts and torch.equal(a.completion_ids, b.completion_ids)


def test_checkpointing_saves_less_for_backward(tiny_model_path):
    # The memory side: tensors saved for backward in one training forward, with and without.
    tokenizer, ids, rollout, _ = rollout_batch(tiny_model_path)
    prompts = [p for p in ids for _ in range(3)]                           # G = 3 completions each
    input_ids, attention = batch_inputs(prompts, rollout.completion_ids, rollout.mask, tokenizer.pad_token_id)
    saved = {}
    for checkpointing in (False, True):
        policy = build_policy(tiny_model_path, chunk_tokens=64, gradient_checkpointing=checkpointing).train()
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            policy(input_ids, attention, rollout.mask.shape[1], 1.0)
        saved[checkpointing] = sum(total)
    assert saved[True] < 0.5 * saved[False]
