"""Train/eval modes around the update, and gradient checkpointing that really recomputes.

transformers recomputes a checkpointed layer only when the module is in train mode, and in train
mode a checkpointed layer drops the KV cache, so `generate` must run in eval mode: the policy is
built in eval mode, `logprobs.score_policy` scores π_old / π_ref in eval mode, `policy_update` runs
the update in train mode and hands the policy back in eval mode. Checkpointing may change memory, never results.
"""
import copy

import torch

from pspo import distributed
from pspo.advantages import reinforce_pp_advantages
from pspo.config import load_config
from pspo.data import builtin_arithmetic, format_prompt
from pspo.distributed import Dist
from pspo.model import build_policy, load_tokenizer
from pspo.rollout import HFEngine
from pspo.sequences import batch_inputs, sequence_seeds
from pspo.logprobs import score_policy
from pspo.optim import lr_lambda
from pspo.sequences import UpdateBatch
from pspo.update import policy_update

CPU = Dist(0, 1, torch.device("cpu"))


def rollout_batch(path, n_prompts=4, G=3):
    """A real rollout of the tiny model (6 new tokens), as the update receives it."""
    tokenizer = load_tokenizer(path)
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
           for ex in builtin_arithmetic("train")[:n_prompts]]
    engine = HFEngine(build_policy(path, False, 64, False, False), tokenizer, 64)
    r = engine.generate(ids, G, 1.0, 1.0, 6, sequence_seeds(0, 0, torch.arange(n_prompts), G))
    input_ids, attention = batch_inputs([p for p in ids for _ in range(G)], r.completion_ids, r.mask,
                                        tokenizer.pad_token_id)
    advantages = torch.linspace(-1, 1, n_prompts * G)                      # (N,) any non-zero signal
    return tokenizer, ids, input_ids, attention, r.mask, advantages


def method_update(policy, ref, optimizer, scheduler, input_ids, attention, mask, advantages, cfg, dist_,
                  rewards=None):
    """What methods.py hands the optimizer step, then policy_update. GRPO: A (N,) broadcast over each
    completion's tokens. With `rewards` (N,), REINFORCE++: token advantages from them (§A, groups of
    rollout.num_generations for the baseline variant) times `advantages` as the IS weight. π_old is
    scored when the method needs it, π_ref when the run has a reference."""
    a = cfg.algo
    need_old = a.num_iterations > 1 or (rewards is not None and a.kl_coef > 0)
    old, ref_logp = score_policy(policy, ref, input_ids, attention, mask, cfg, need_old, a.needs_reference)
    if rewards is None:
        token_advantages = advantages[:, None].expand_as(mask)             # (N, T)
    else:
        group = cfg.rollout.num_generations if a.advantage == "reinforce_pp_baseline" else None
        token_advantages = reinforce_pp_advantages(rewards, mask, old, ref_logp, a.kl_coef, a.clip_score, group,
                                                   a.whiten, reduce_sum=distributed.all_reduce_sum)
        token_advantages = token_advantages * advantages[:, None]          # (N, T)
    batch = UpdateBatch(input_ids, attention, mask, mask, token_advantages, old, ref_logp)
    return policy_update(policy, optimizer, scheduler, batch, cfg, dist_)


def run_update(path, batch, checkpointing, overrides=()):
    """π_old / π_ref scored as the methods do, then one policy_update, with a decoder layer's forward
    calls recorded as (training, grad enabled)."""
    cfg = load_config("configs/grpo.yaml", ["--train.micro_batch_size=4", *overrides])
    policy = build_policy(path, False, 64, False, checkpointing)
    ref = build_policy(path, False, 64, False, False, trainable=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    calls = []
    layer = policy.lm.model.layers[1]
    layer.register_forward_pre_hook(lambda module, args: calls.append((module.training, torch.is_grad_enabled())))
    _, _, input_ids, attention, mask, advantages = batch
    assert not policy.training                                              # built in eval mode
    method_update(policy, ref, optimizer, scheduler, input_ids, attention, mask, advantages, cfg, CPU)
    assert not policy.training and not ref.training                         # handed back in eval mode
    return policy, calls


def test_scoring_runs_in_eval_mode_and_the_update_in_train_mode(tiny_model_path):
    batch = rollout_batch(tiny_model_path)
    # 12 sequences, micro-batches of 4 -> 3 micro-batches; 2 iterations; π_old scored up front (π_ref
    # runs on the reference model, whose layer is not hooked).
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
    base = build_policy(tiny_model_path, False, 64, False, False)
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
    _, _, input_ids, attention, mask, _ = rollout_batch(tiny_model_path)
    saved = {}
    for checkpointing in (False, True):
        policy = build_policy(tiny_model_path, False, 64, False, checkpointing).train()
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            policy(input_ids, attention, mask.shape[1], 1.0)
        saved[checkpointing] = sum(total)
    assert saved[True] < 0.5 * saved[False]
