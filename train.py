"""PSPO / GRPO / Dr. GRPO fine-tuning with verifiable rewards: the whole algorithm in one visible loop.

    python train.py --config configs/grpo.yaml [--section.key=value ...]          # one process
    torchrun --nproc_per_node=N train.py --config configs/grpo.yaml               # FSDP2, N ranks
    python train.py --config X --plan [--gpus=8] [--gpu_gib=80]    # per-GPU memory plan, no GPU needed

Each step: sample B prompts (uniform epochs, or PPS §3) -> G completions each -> rewards ->
advantages (GRPO §1, or ERS-smoothed §2) -> PPS priorities -> num_iterations x (micro-batched
clipped-surrogate loss with gradient accumulation, grad-norm clip, AdamW step) -> log -> periodic
eval -> periodic save. PSPO (§4) = ERS + PPS; `ers.enabled` and `pps.enabled` switch each on.
SPO (SEED_METHODS.md §B, pspo/spo.py) brings token advantages: from Monte Carlo values at cut
points (spo_chain), or from trees grown from the G completions, trained as replayed edges (spo_tree).

How this departs from TRL's GRPOTrainer, on purpose:
- The loss is normalized over the whole optimizer step (every micro-batch and rank), so the
  gradient does not depend on how the batch is split (TRL normalizes per micro-batch).
- Sampling is counter-based (rollout.py): completions do not depend on the number of ranks.
- Dr. GRPO is the paper's (no std scaling, dr_grpo aggregation, β = 0), not a loss flag alone.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
from tqdm import tqdm

from pspo import checkpoint, distributed
from pspo.checkpoint import CheckpointError
from pspo.advantages import group_advantages, smoothed_advantages, zero_variance
from pspo.config import Config, ConfigError, load_config, save_config
from pspo.data import DataError, PromptSet, load_examples, prompt_set
from pspo.distributed import Dist, print0
from pspo.ema_stats import EMAStats
from pspo.evaluation import evaluate
from pspo.metrics import MetricsLogger, gpu_memory, step_metrics
from pspo.model import (ModelError, build_policy, check_context, load_model_config, load_tokenizer,
                        resolve_model_path)
from pspo.plan import plan_cli, startup_check
from pspo.reward_pool import RewardPool, resolve_workers
from pspo.rewards import score_completions
from pspo.rollout import CountingEngine, HFEngine, build_engine, engine_name
from pspo.sequences import batch_inputs, sequence_seeds
from pspo.update import policy_update
from pspo.sampler import build_sampler
from pspo.spo import SPOTree, chain_inputs
from pspo.vllm_engine import SyncError, sync_engine


MAX_SKIPPED_IN_A_ROW = 3     # non-finite updates in a row before the run stops


class NonFiniteError(RuntimeError):
    """Several updates in a row were non-finite: the run stops (weights untouched, saved)."""


def lr_lambda(cfg: Config):
    """Linear warm-up to optim.lr, then cosine decay to lr * min_lr_ratio over all optimizer steps."""
    total = cfg.train.max_steps * cfg.algo.num_iterations
    warmup, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def adopt_optim_config(optimizer: torch.optim.Optimizer, scheduler, cfg: Config) -> None:
    """After a resume, AdamW's settings come from the config like every other field (the saved
    optimizer state would otherwise restore its old lr, betas and weight decay), and the learning
    rate is the config's at the restored step of the schedule."""
    o = cfg.optim
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, lr=o.lr * factor, betas=(o.adam_beta1, o.adam_beta2),
                     weight_decay=o.weight_decay)


def load_replicated_state(state: dict, sampler, ers: EMAStats | None, tree: SPOTree | None, cfg: Config) -> None:
    """Sampler, ERS and SPO-tree replay state from a checkpoint; refuses a run that switched PPS or ERS on or off.

    Their hyperparameters (ers.alpha, pps.alpha, beta, ...) come from the config and may change on
    resume like any other field; an exact continuation needs the same config.
    """
    pps_state = "priorities" in state["sampler"] or "reference_priorities" in state["sampler"]
    for key, on, was_on in (("pps.enabled", cfg.pps.enabled, pps_state),
                            ("ers.enabled", cfg.ers.enabled, state.get("ers") is not None)):
        if on != was_on:
            raise ConfigError(f"{key}: the checkpoint was trained with {key}={str(was_on).lower()}; "
                              "resume with the same setting")
    try:
        sampler.load_state_dict(state["sampler"])
        if ers is not None:
            ers.load_state_dict(state["ers"])
        if tree is not None and state.get("spo_tree") is not None:
            tree.load_state_dict(state["spo_tree"])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def main(argv: list[str]) -> None:
    if "--plan" in argv:                          # memory plan only: no GPU, no download (README "Will it fit?")
        print0(plan_cli(argv))
        return
    dist_ = distributed.init_distributed()
    if len(argv) < 2 or argv[0] != "--config":
        raise ConfigError("usage: train.py --config FILE.yaml [--section.key=value ...]")
    cfg = load_config(argv[1], argv[2:], dist_.world_size)
    torch.manual_seed(cfg.train.seed)
    out = cfg.train.output_dir
    if dist_.is_main:
        os.makedirs(out, exist_ok=True)
        save_config(cfg, os.path.join(out, "config.yaml"))
        base_path = resolve_model_path(cfg.model.name_or_path)          # builds builtin:tiny once
    distributed.barrier()
    base_path = resolve_model_path(cfg.model.name_or_path)
    resume_from = checkpoint.resolve_resume(cfg.train.resume, out)
    m, reward_pool = cfg.model, RewardPool(resolve_workers(cfg.reward.workers, torch.get_num_threads()))  # pool starts now

    # ---- set-up: tokenizer, policy (+ frozen reference), engine, data, optimizer, state ----
    tokenizer = load_tokenizer(base_path, m.trust_remote_code)
    check_context(load_model_config(base_path, m.trust_remote_code), cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
    print0(startup_check(cfg, base_path, dist_.world_size, dist_.device))       # PlanError (exit 2) if it cannot fit
    policy = build_policy(resume_from or base_path, m.trust_remote_code, m.logprob_chunk_tokens, m.bf16,
                          m.gradient_checkpointing).to(dist_.device)
    policy = distributed.shard(policy, dist_.world_size)
    ref = None
    if cfg.algo.needs_reference:                  # the k3 loss term (β > 0) or REINFORCE++'s KL reward (§6)
        ref = build_policy(base_path, m.trust_remote_code, m.logprob_chunk_tokens, m.bf16, False, trainable=False)
        ref = distributed.shard(ref.to(dist_.device), dist_.world_size)
    d = cfg.data                       # rows without a usable gold and too-long prompts are left out, reported
    train_rows = load_examples(d.train, d.train_split, d.problem_field, d.answer_field, d.max_train_examples or None,
                               people=d.people)
    train = prompt_set(f"data.train {d.train}", train_rows, tokenizer, d.system_prompt, d.max_prompt_tokens, d.bad_gold)
    train_set, train_texts, train_ids = train.examples, train.texts, train.ids
    evals = prompt_set(f"data.eval {d.eval}", load_examples(d.eval, d.eval_split, d.problem_field, d.answer_field,
                                                            d.max_eval_examples or None),
                       tokenizer, d.system_prompt, d.max_prompt_tokens, d.bad_gold) if d.eval else PromptSet([], [], [])
    eval_set, eval_texts, eval_ids = evals.examples, evals.texts, evals.ids
    B = cfg.train.prompts_per_step
    sampler = build_sampler(cfg, [ex.problem for ex in train_set], d.train)     # uniform, PPS or §3a's
    ers = EMAStats(cfg.ers.alpha) if cfg.ers.enabled else None
    distinct_problems = len({ex.problem for ex in train_set})                   # ERS keys merge duplicates
    o = cfg.optim
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # FSDP ranks generating with the policy itself must run the same forward passes (spo.py pads)
    lockstep = dist_.world_size > 1 and engine_name(cfg.rollout.engine) == "hf"
    tree = SPOTree(cfg, train_ids, tokenizer.pad_token_id, dist_, lockstep) \
        if cfg.algo.advantage == "spo_tree" else None                         # SPO-tree's replay buffer
    step, generated_tokens = 0, 0.0           # generated: every token training generation returned, all ranks
    if resume_from:
        state = checkpoint.load_trainer_state(resume_from, dist_.rank)
        checkpoint.load_optimizer(resume_from, policy, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        adopt_optim_config(optimizer, scheduler, cfg)
        load_replicated_state(state, sampler, ers, tree, cfg)
        step, generated_tokens = state["step"], state.get("generated_tokens", 0.0)   # 0: saved before it was counted
        print0(f"resumed from {resume_from} at step {step}")
    max_prompt_len = max(len(p) for p in train_ids + eval_ids)
    engine = build_engine(cfg.rollout, policy, resume_from or base_path, tokenizer, max_prompt_len, cfg.train.seed,
                          dist_.world_size, m.bf16)
    separate_engine = not isinstance(engine, HFEngine)                         # holds its own weights: sync
    counter = CountingEngine(engine)                  # training's generation, counted (evaluation and sync: not)
    logger = MetricsLogger(out, dist_.is_main, resume_step=step)

    def run_eval() -> dict[str, float]:
        e = cfg.eval
        result = evaluate(engine, eval_ids, eval_texts, eval_set, cfg.rollout.max_new_tokens, e.num_samples,
                          e.temperature, e.top_p, cfg.train.seed, dist_, e.batch_size, cfg.reward.timeout_s,
                          cfg.train.progress, reward_pool)
        return {"eval_accuracy": result.pop("greedy_accuracy"), **{f"eval_{k}": v for k, v in result.items()}}

    def save() -> None:
        state = {"step": step, "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
                 "ers": ers.state_dict() if ers is not None else None, "generated_tokens": generated_tokens,
                 "spo_tree": tree.state_dict() if tree is not None else None}
        path = checkpoint.save_checkpoint(out, step, policy, tokenizer, optimizer, state, dist_,
                                          cfg.train.keep_checkpoints)
        print0(f"saved {path}")

    first_eval = run_eval() if eval_set and step == 0 else {}
    if first_eval:
        logger.log(0, first_eval)
        print0(f"step 0: test accuracy {first_eval['eval_accuracy']:.3f} (greedy, {len(eval_set)} problems)")

    # ---- the loop ----
    G, r, a = cfg.rollout.num_generations, cfg.rollout, cfg.algo
    B_local = B // dist_.world_size
    mine = slice(dist_.rank * B_local, (dist_.rank + 1) * B_local)                # this rank's rows of the batch
    # accuracy and format are always scored (logged even at weight 0; on K&K golds they are the K&K
    # exact match and tag check, rewards.py); cosine and knights only when weighted
    weights = {"accuracy": cfg.reward.accuracy, "format": cfg.reward.format}
    weights.update({k: getattr(cfg.reward, k) for k in ("cosine", "knights") if getattr(cfg.reward, k)})

    def score(examples: list[int], texts: list[str]):        # completions of these train rows -> RewardResult
        return score_completions([train_texts[i] for i in examples], texts, [train_set[i].answer for i in examples],
                                 weights, cfg.reward.timeout_s, reward_pool)
    last_eval = first_eval
    skipped_in_a_row = 0                                                          # non-finite updates
    preemption = distributed.PreemptionSignal()                                   # SIGTERM / SIGUSR1
    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=not (dist_.is_main and cfg.train.progress))
    while step < cfg.train.max_steps:
        t0 = time.perf_counter()
        indices, is_weights = sampler.sample(B)                                   # (B,), (B,) same on all ranks
        bookkeeping_s = time.perf_counter() - t0
        local = indices[mine]
        seeds = sequence_seeds(cfg.train.seed, step, torch.arange(B)[mine], G)    # (B_local*G,)
        device, t_gen = dist_.device, time.perf_counter()
        if tree is not None:      # SPO-tree (§B): trees grown from the G completions, trained as replayed edges
            batch = tree.step(counter, policy, local.tolist(), seeds, step, score)
            input_ids, attention_mask, mask, spo_inputs, local_sums = (batch.input_ids, batch.attention_mask,
                                                                       batch.mask, batch.update, batch.sums)
            times = {"gen_s": time.perf_counter() - t_gen - batch.reward_s, "reward_s": batch.reward_s}
            pg_advantages, token_rewards = torch.ones(mask.shape[0]), None
        else:
            rollout = counter.generate([train_ids[i] for i in local], G, r.temperature, r.top_p, r.max_new_tokens,
                                       seeds)
            t_reward = time.perf_counter()
            rows = [i for i in local.tolist() for _ in range(G)]                  # prompt-major
            scored = score(rows, rollout.texts)
            # The whole (B, G) reward matrix on every rank: ERS and PPS state stay identical everywhere.
            rewards = distributed.all_gather_rows(scored.rewards.view(B_local, G), dist_.device)   # (B, G)
            t1 = time.perf_counter()
            times = {"gen_s": t_reward - t_gen, "reward_s": t1 - t_reward}
            advantages = group_advantages(rewards, a.scale_rewards, a.adv_eps)   # (B, G) §1
            is_weights = is_weights[:, None].expand(B, G)                         # (B, G)
            if cfg.pps.enabled:       # §3: p_q from the raw |A| (or the accuracy, posterior); §3a's w per completion
                successes = distributed.all_gather_rows(scored.components["accuracy"].view(B_local, G), dist_.device) \
                    if cfg.pps.priority == "posterior" else None                  # (B, G) r̂ in [0, 1]
                is_weights = sampler.update(indices, advantages.abs(), successes)
            if ers is not None:                                                   # §2: m_q, v_q after the update
                problems = [train_set[i].problem for i in indices.tolist()]
                ers_mean, ers_std = ers.update(problems, rewards)                 # (B,), (B,)
                advantages = smoothed_advantages(rewards, ers_mean, ers_std, a.scale_rewards, a.adv_eps)
            bookkeeping_s += time.perf_counter() - t1
            # (N,) the PPS IS weight, PG term only. Token-level advantages (REINFORCE++ §6 in policy_update,
            # from the raw rewards and the π_old / π_ref log-probs; SPO-chain below) are multiplied by w alone.
            token_level = a.advantage != "grpo"
            weighted = (torch.ones_like(advantages) if token_level else advantages) * is_weights   # (B, G)
            pg_advantages = weighted[mine].reshape(-1)                            # (N,)
            token_rewards, mask = rewards[mine].reshape(-1) if token_level else None, rollout.mask   # (N,), (N, T)
            input_ids, attention_mask = batch_inputs([train_ids[i] for i in rows], rollout.completion_ids, mask,
                                                     tokenizer.pad_token_id)
            my_rewards, my_adv = rewards[mine], advantages[mine]
            local_sums = {
                "completions": my_rewards.numel(), "groups": B_local, "completion_tokens": mask.sum(),
                "reward": my_rewards.sum(), "reward_sq": (my_rewards ** 2).sum(),
                "accuracy": scored.components["accuracy"].sum(), "format": scored.components["format"].sum(),
                "adv_abs": my_adv.abs().sum(), "adv_sq": (my_adv ** 2).sum(), "adv_count": my_adv.numel(),
                "zero_std_groups": zero_variance(my_rewards).sum(), "truncated": rollout.truncated.sum(),
                "reward_failures": sum(scored.failures.values())}
            spo_inputs = {}
            if a.advantage == "spo_chain":    # §B chain: MC values at the cuts -> token A, loss mask M, π_old
                t_spo = time.perf_counter()
                spo_inputs, spo_counts = chain_inputs(policy, counter, rollout, token_rewards,
                                                      [train_ids[i] for i in rows], rows, score, cfg, step,
                                                      tokenizer.pad_token_id, device, lockstep)
                local_sums.update(spo_counts)
                times["spo_s"] = time.perf_counter() - t_spo
        t_update = time.perf_counter()
        if separate_engine:
            engine.sleep()                                                        # GPU: free it for the update
        update = policy_update(policy, ref, optimizer, scheduler, input_ids.to(device), attention_mask.to(device),
                               mask.to(device), pg_advantages.to(device), cfg, dist_,
                               None if token_rewards is None else token_rewards.to(device), **spo_inputs)
        step += 1
        t_sync = time.perf_counter()
        times["update_s"] = t_sync - t_update
        skipped_in_a_row = skipped_in_a_row + 1 if update["skipped_steps"] else 0
        sync_metrics = sync_engine(engine, policy, [train_ids[i] for i in local[:4]], step, r, cfg.train.seed,
                                   device) if separate_engine else {}
        times["sync_s"] = time.perf_counter() - t_sync
        if sync_metrics.get("sync_gap_mean", 0.0) > r.sync_check_tol:                # stale engine: save, stop
            save()
            raise SyncError(f"rollout.sync_check_tol: at step {step} the engine's log-probs differ from the trainer's "
                            f"by {sync_metrics['sync_gap_mean']:.4g} per token on average (max "
                            f"{sync_metrics['sync_gap_max']:.4g}) > {r.sync_check_tol}: its weights are stale")

        counts = counter.take()                                                   # this step's generation, by kind
        local_sums.update(update, **counts, gen_tokens_per_s=(counts["rollout_tokens"] + counts["mc_tokens"]) /
                          max(counts["rollout_gen_s"] + counts["mc_gen_s"], 1e-9))   # update: token-level adv_*
        sums = distributed.reduce_sums(local_sums, device)
        generated_tokens += sums["rollout_tokens"] + sums["mc_tokens"]
        metrics = step_metrics(sums, cfg)
        metrics.update({k: v for k, v in sums.items() if k.startswith("spo_") or k in CountingEngine.KEYS},
                       generated_tokens=generated_tokens, lr=scheduler.get_last_lr()[0])
        # ERS/PPS diagnostics come from the replicated state: the same on every rank, not summed.
        if ers is not None:
            metrics.update({f"ers_{k}": v for k, v in ers.batch_stats(problems, rewards, ers_mean,
                                                                      distinct_problems).items()})
        if cfg.pps.enabled:
            metrics.update({f"pps_{k}": v for k, v in sampler.batch_stats().items()})
            metrics["rollouts_saved"] = metrics.get("pps_skipped", 0.0) * G              # skipped before generation
        metrics.update(bookkeeping_s=bookkeeping_s, **gpu_memory(device))            # + peak_mem_gib on a GPU
        metrics.update(sync_metrics, **times)                                     # times: this rank's (rank 0 logs)
        metrics["update_tokens_per_s"] = sums["update_tokens"] / max(times["update_s"], 1e-9)   # all ranks' tokens
        metrics["step_time_s"] = time.perf_counter() - t0                         # evaluation excluded
        if eval_set and (step == cfg.train.max_steps or (cfg.train.eval_steps and step % cfg.train.eval_steps == 0)):
            t_eval = time.perf_counter()
            last_eval = run_eval()
            metrics.update(last_eval, eval_s=time.perf_counter() - t_eval)
        logger.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                        step_s=f"{metrics['step_time_s']:.2f}")
        saved = step == cfg.train.max_steps or bool(cfg.train.save_steps and step % cfg.train.save_steps == 0)
        if saved or skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
            save()
        if skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
            raise NonFiniteError(f"optim.lr: {MAX_SKIPPED_IN_A_ROW} updates in a row had a non-finite loss or "
                                 f"gradient norm (steps {step - MAX_SKIPPED_IN_A_ROW + 1}-{step}); they were "
                                 "skipped and the weights are as before them (saved). Lower optim.lr or "
                                 "check the model and data, then resume with --train.resume=auto")
        if preemption.requested(dist_.device):                                   # the scheduler's warning
            if not saved:
                save()
            print0(f"{preemption.name or 'a stop signal'} received: stopped after step {step} with a checkpoint; "
                   "continue with --train.resume=auto")
            break

    bar.close()
    logger.close()
    reward_pool.close()                                # on an error too, when collected (reward_pool.py)
    finished = step == cfg.train.max_steps                                        # not preempted
    if finished and first_eval and last_eval:
        k = f"eval_mean@{cfg.eval.num_samples}"                     # sampled accuracy (eval.num_samples > 0)
        print0(f"test accuracy: {first_eval['eval_accuracy']:.3f} before -> {last_eval['eval_accuracy']:.3f} after "
               f"(greedy, {len(eval_set)} problems)" + (f"; {k[5:]} at T {cfg.eval.temperature}: {first_eval[k]:.3f}"
                                                        f" -> {last_eval[k]:.3f}" if k in last_eval else ""))
    elif finished and last_eval:
        print0(f"test accuracy after step {step}: {last_eval['eval_accuracy']:.3f}")
    print0(f"metrics: {os.path.join(out, 'metrics.jsonl')}   TensorBoard: tensorboard --logdir {out}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, ModelError, CheckpointError, FileNotFoundError, ImportError, SyncError,
            NonFiniteError) as e:
        print0(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        distributed.shutdown(clean=sys.exc_info()[0] is None)          # None: main returned
