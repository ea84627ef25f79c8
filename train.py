"""RL fine-tuning with verifiable rewards: PSPO, GRPO, Dr. GRPO, REINFORCE++ and SPO in one visible loop.

    python train.py --config configs/grpo.yaml [--section.key=value ...]          # one process
    torchrun --nproc_per_node=N train.py --config configs/grpo.yaml               # FSDP2, N ranks
    python train.py --config X --plan [--gpus=8] [--gpu_gib=80]    # per-GPU memory plan, no GPU needed

Each step (docs/methods.md): sample B prompts (uniform epochs, or PPS §3) -> G completions each ->
rewards (§5) -> PPS priorities and importance weights -> the advantage method's token advantages
(methods.py: GRPO / Dr. GRPO §1, ERS §2, REINFORCE++ and SPO in docs/related.md) -> num_iterations x
(micro-batched clipped-surrogate loss with gradient accumulation, grad-norm clip, AdamW step) -> log
-> periodic eval -> periodic save. PSPO (§4) = ERS + PPS.

How this departs from TRL's GRPOTrainer, on purpose:
- The loss is normalized over the whole optimizer step (every micro-batch and rank), so the
  gradient does not depend on how the batch is split (TRL normalizes per micro-batch).
- Sampling is counter-based (rollout.py): completions do not depend on the number of ranks.
- Dr. GRPO is the paper's (no std scaling, dr_grpo aggregation, β = 0), not a loss flag alone.
"""
from __future__ import annotations

import os
import sys

import torch
from tqdm import tqdm

from pspo.training import checkpoint

from pspo.training import distributed
from pspo.training.checkpoint import CheckpointError
from pspo.training.config import Config, ConfigError, load_config, save_config
from pspo.tasks.data import DataError, PromptSet, load_examples, prompt_set
from pspo.training.distributed import Dist, print0
from pspo.evaluation import evaluate
from pspo.methods import Context, StepRollouts, method_for
from pspo.training.metrics import MetricsLogger, StepClock, gpu_memory, step_record
from pspo.offline.builtin import resolve_model_path
from pspo.training.model import ModelError, build_policy, check_context, load_model_config, load_tokenizer
from pspo.training.optim import adopt_optim_config, build_optimizer
from pspo.training.plan import plan_cli, startup_check
from pspo.related.prm import load_prm, prm_metrics
from pspo.tasks.reward_pool import RewardPool, resolve_workers
from pspo.rewards import RewardResult, score_completions
from pspo.rollout import CountingEngine, build_engine, engine_name
from pspo.engines.hf_engine import HFEngine
from pspo.sampler import build_sampler, importance_weights, sampler_metrics, sampler_mode
from pspo.engines.sampling import sequence_seeds
from pspo.update import policy_update
from pspo.engines.vllm_engine import SyncError, stale_engine, sync_engine

MAX_SKIPPED_IN_A_ROW = 3     # non-finite updates in a row before the run stops


class NonFiniteError(RuntimeError):
    """Several updates in a row were non-finite: the run stops (weights untouched, saved)."""


def main(argv: list[str]) -> None:
    if "--plan" in argv:                          # memory plan only: no GPU, no download (docs/gpu.md)
        print0(plan_cli(argv))
        return
    dist_ = distributed.init_distributed()
    if len(argv) < 2 or argv[0] != "--config":
        raise ConfigError("usage: train.py --config FILE.yaml [--section.key=value ...]")
    cfg = load_config(argv[1], argv[2:], dist_.world_size)
    torch.manual_seed(cfg.train.seed)
    out, m, r = cfg.train.output_dir, cfg.model, cfg.rollout
    if dist_.is_main:
        os.makedirs(out, exist_ok=True)
        save_config(cfg, os.path.join(out, "config.yaml"))
        resolve_model_path(m.name_or_path)                            # builds a builtin model once
    distributed.barrier()
    base_path = resolve_model_path(m.name_or_path)
    resume_from = checkpoint.resolve_resume(cfg.train.resume, out)
    reward_pool = RewardPool(resolve_workers(cfg.reward.workers, torch.get_num_threads()))   # starts now

    # ---- set-up: tokenizer, policy (+ frozen reference), data, method, optimizer, state, engine ----
    tokenizer = load_tokenizer(base_path, m.trust_remote_code)
    check_context(load_model_config(base_path, m.trust_remote_code), cfg.data.max_prompt_tokens,
                  r.max_new_tokens)
    # PlanError (exit 2) if it cannot fit
    print0(startup_check(cfg, base_path, dist_.world_size, dist_.device, engine_name(r.engine)))
    prm = load_prm(cfg, dist_.device)             # reward.prm != 0: PSPO*'s frozen process reward model (§C)
    policy = build_policy(resume_from or base_path, m.trust_remote_code, m.logprob_chunk_tokens, m.bf16,
                          m.gradient_checkpointing).to(dist_.device)
    policy = distributed.shard(policy, dist_.world_size, m.bf16)
    ref = None
    if cfg.algo.needs_reference:                  # the k3 loss term (β > 0) or REINFORCE++'s KL reward
        ref = build_policy(base_path, m.trust_remote_code, m.logprob_chunk_tokens, m.bf16, False,
                           trainable=False)
        ref = distributed.shard(ref.to(dist_.device), dist_.world_size, m.bf16)
    train, evals = prompt_sets(cfg, tokenizer)
    # uniform, PPS or §3a's
    sampler = build_sampler(cfg, [ex.problem for ex in train.examples], cfg.data.train)
    # FSDP ranks generating with the policy itself must run the same forward passes (spo.py pads)
    lockstep = dist_.world_size > 1 and engine_name(r.engine) == "hf"
    method = method_for(cfg, train.ids, tokenizer.pad_token_id, dist_, lockstep)   # the one choice of method
    optimizer, scheduler = build_optimizer(policy, cfg)
    step, generated_tokens = 0, 0.0           # generated: every token training generation returned, all ranks
    if resume_from:
        state = checkpoint.load_trainer_state(resume_from, dist_.rank)
        checkpoint.load_optimizer(resume_from, policy, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        adopt_optim_config(optimizer, scheduler, cfg)
        checkpoint.restore_trainer_state(state, sampler, method.state, cfg, sampler_mode(cfg))
        step, generated_tokens = state["step"], state.get("generated_tokens", 0.0)
        print0(f"resumed from {resume_from} at step {step}")
    max_prompt_len = max(len(p) for p in train.ids + evals.ids)
    engine = build_engine(r, policy, resume_from or base_path, tokenizer, max_prompt_len, cfg.train.seed,
                          dist_.world_size, m.bf16)
    separate_engine = not isinstance(engine, HFEngine)                     # holds its own weights: sync
    counter = CountingEngine(engine)              # training's generation, counted (evaluation and sync: not)
    logger = MetricsLogger(out, dist_.is_main, resume_step=step)
    weights = reward_weights(cfg)

    def score(examples: list[int], texts: list[str]) -> RewardResult:   # completions of these train rows
        prompts, golds = [train.texts[i] for i in examples], [train.examples[i].answer for i in examples]
        return score_completions(prompts, texts, golds, weights, cfg.reward.timeout_s, reward_pool, prm)

    def run_eval() -> dict[str, float]:
        return evaluation(engine, evals, cfg, dist_, reward_pool)

    def save() -> None:
        state = checkpoint.trainer_state(step, scheduler, sampler, method.state, generated_tokens, cfg,
                                         sampler_mode(cfg))
        path = checkpoint.save_checkpoint(out, step, policy, tokenizer, optimizer, state, dist_,
                                          cfg.train.keep_checkpoints)
        print0(f"saved {path}")

    first_eval = run_eval() if evals.examples and step == 0 else {}
    if first_eval:
        logger.log(0, first_eval)
        print0(f"step 0: test accuracy {first_eval['eval_accuracy']:.3f} "
               f"(greedy, {len(evals.examples)} problems)")

    # ---- the loop ----
    B, G = cfg.train.prompts_per_step, r.num_generations
    B_local = B // dist_.world_size
    mine = slice(dist_.rank * B_local, (dist_.rank + 1) * B_local)            # this rank's rows of the batch
    problems = [ex.problem for ex in train.examples]
    # vLLM frees its GPU memory (rollout.sleep)
    release = engine.sleep if separate_engine else (lambda: None)
    ctx = Context(cfg, policy, ref, counter, train.ids, problems, tokenizer.pad_token_id, dist_, mine,
                  lockstep, score, release, len(set(problems)), method.state)
    last_eval, skipped_in_a_row = first_eval, 0                               # non-finite updates in a row
    preemption = distributed.PreemptionSignal()                               # SIGTERM / SIGUSR1
    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=not (dist_.is_main and cfg.train.progress))
    while step < cfg.train.max_steps:
        clock = StepClock()
        with clock("bookkeeping_s"):
            indices, is_weights = sampler.sample(B)                             # (B,), (B,) same on all ranks
        local = indices[mine].tolist()                                          # this rank's prompts
        rows = [i for i in local for _ in range(G)]                             # (N,) prompt-major
        seeds = sequence_seeds(cfg.train.seed, step, torch.arange(B)[mine], G)  # (N,)
        with clock("gen_s"):
            rollout = counter.generate([train.ids[i] for i in local], G, r.temperature, r.top_p,
                                       method.max_new_tokens, seeds)
        with clock("reward_s"):
            scored = score(rows, rollout.texts)
            rewards, accuracy = gather_scores(scored, B_local, G)               # (B, G) each, every rank's
        with clock("bookkeeping_s"):                                            # PPS: priorities, IS weights
            is_weights = importance_weights(sampler, cfg, indices, is_weights, rewards, accuracy)   # (B, G)
        # the engine sleeps once done
        with clock("advantages_s"):
            step_rollouts = StepRollouts(step, indices, rows, seeds, rollout, scored, rewards, is_weights)
            result = method.advantages(step_rollouts, ctx)                      # token advantages, loss mask
        with clock("update_s"):
            update = policy_update(policy, optimizer, scheduler, result.batch, cfg, dist_)
        step += 1
        with clock("sync_s"):
            sync = sync_engine(engine, policy, [train.ids[i] for i in local[:4]], step, r, cfg.train.seed,
                               dist_.device) if separate_engine else {}
        stale = stale_engine(sync, step, r)                                     # the engine's weights lag
        if stale is not None:
            save()
            raise stale
        skipped_in_a_row = skipped_in_a_row + 1 if update["skipped_steps"] else 0
        sums, metrics = step_record({**result.sums, **update}, counter.take(), cfg, dist_.device)
        generated_tokens += sums["rollout_tokens"] + sums["mc_tokens"]
        metrics.update(result.metrics, **sampler_metrics(sampler, cfg), **sync, **gpu_memory(dist_.device),
                       **prm_metrics(prm, dist_.device, clock.elapsed()))
        metrics.update(timings(clock, result.times, sums), generated_tokens=generated_tokens,
                       lr=scheduler.get_last_lr()[0])
        if evals.examples and (step == cfg.train.max_steps or every(step, cfg.train.eval_steps)):
            with clock("eval_s"):
                last_eval = run_eval()
            metrics.update(last_eval, eval_s=clock.times["eval_s"])
        logger.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                        step_s=f"{metrics['step_time_s']:.2f}")
        saved = step == cfg.train.max_steps or every(step, cfg.train.save_steps)
        if saved or skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
            save()
        if skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
            raise non_finite_error(step)
        if preemption.requested(dist_.device):                                  # the scheduler's warning
            if not saved:
                save()
            print0(f"{preemption.name or 'a stop signal'} received: stopped after step {step} "
                   "with a checkpoint; continue with --train.resume=auto")
            break

    bar.close()
    logger.close()
    reward_pool.close()                                # on an error too, when collected (reward_pool.py)
    print0(summary(cfg, step, first_eval, last_eval, len(evals.examples)))


# ---- helpers of the loop ----

def prompt_sets(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet]:
    """The train and eval prompts, formatted and tokenized; rows without a usable gold and prompts
    over data.max_prompt_tokens are left out and reported."""
    d = cfg.data
    rows = load_examples(d.train, d.train_split, d.problem_field, d.answer_field,
                         d.max_train_examples or None, people=d.people)
    train = prompt_set(f"data.train {d.train}", rows, tokenizer, d.system_prompt, d.max_prompt_tokens,
                       d.bad_gold)
    if not d.eval:
        return train, PromptSet([], [], [])
    rows = load_examples(d.eval, d.eval_split, d.problem_field, d.answer_field, d.max_eval_examples or None)
    return train, prompt_set(f"data.eval {d.eval}", rows, tokenizer, d.system_prompt, d.max_prompt_tokens,
                             d.bad_gold)


def reward_weights(cfg: Config) -> dict[str, float]:
    """Accuracy and format are always scored (logged even at weight 0; on K&K golds they are the K&K
    exact match and tag check, rewards.py); cosine, knights and the process reward only when weighted."""
    weights = {"accuracy": cfg.reward.accuracy, "format": cfg.reward.format}
    optional = ("cosine", "knights", "prm")
    weights.update({k: getattr(cfg.reward, k) for k in optional if getattr(cfg.reward, k)})
    return weights


def gather_scores(scored: RewardResult, B_local: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rewards and accuracies (N,) -> every rank's, (B, G) each: the replicated ERS and PPS
    state sees the whole batch on every rank. Collective."""
    rewards = distributed.all_gather_rows(scored.rewards.view(B_local, G))
    accuracy = distributed.all_gather_rows(scored.components["accuracy"].view(B_local, G))
    return rewards, accuracy


def evaluation(engine, evals: PromptSet, cfg: Config, dist_: Dist,
               reward_pool: RewardPool) -> dict[str, float]:
    """Greedy accuracy (and mean@k with eval.num_samples) on the eval set, as logged metrics."""
    e = cfg.eval
    result = evaluate(engine, evals.ids, evals.texts, evals.examples,
                      max_new_tokens=cfg.rollout.max_new_tokens, num_samples=e.num_samples,
                      temperature=e.temperature, top_p=e.top_p, seed=cfg.train.seed, dist_=dist_,
                      batch_size=e.batch_size, timeout_s=cfg.reward.timeout_s, progress=cfg.train.progress,
                      pool=reward_pool)
    return {"eval_accuracy": result.pop("greedy_accuracy"), **{f"eval_{k}": v for k, v in result.items()}}


def every(step: int, interval: int) -> bool:
    """A periodic event (eval, save) is due at this step; interval 0 = never."""
    return bool(interval) and step % interval == 0


def timings(clock: StepClock, method_times: dict[str, float], sums: dict[str, float]) -> dict[str, float]:
    """The step's phase times (this rank's; rank 0 logs). What a method reports of its own time as
    another phase's moves there from advantages_s: SPO-tree's leaf scoring to reward_s, the GRPO
    advantages and ERS statistics to bookkeeping_s (with the sampler's work). advantages_s keeps
    the rest: π_old / π_ref scoring and SPO's continuations. Evaluation is excluded."""
    for key, seconds in method_times.items():
        clock.add(key, seconds)
        clock.add("advantages_s", -seconds)
    times = dict(clock.times)
    times["update_tokens_per_s"] = sums["update_tokens"] / max(times["update_s"], 1e-9)   # all ranks' tokens
    times["step_time_s"] = clock.elapsed()
    return times


def non_finite_error(step: int) -> NonFiniteError:
    return NonFiniteError(f"optim.lr: {MAX_SKIPPED_IN_A_ROW} updates in a row had a non-finite loss or "
                          f"gradient norm (steps {step - MAX_SKIPPED_IN_A_ROW + 1}-{step}); they were "
                          "skipped and the weights are as before them (saved). Lower optim.lr or check the "
                          "model and data, then resume with --train.resume=auto")


def summary(cfg: Config, step: int, first_eval: dict, last_eval: dict, num_eval: int) -> str:
    """The run's last lines: test accuracy before -> after (when it finished), and where the metrics are."""
    lines = []
    finished = step == cfg.train.max_steps                                          # not preempted
    if finished and first_eval and last_eval:
        k = f"eval_mean@{cfg.eval.num_samples}"                     # sampled accuracy (eval.num_samples > 0)
        line = (f"test accuracy: {first_eval['eval_accuracy']:.3f} before -> "
                f"{last_eval['eval_accuracy']:.3f} after (greedy, {num_eval} problems)")
        if k in last_eval:
            line += f"; {k[5:]} at T {cfg.eval.temperature}: {first_eval[k]:.3f} -> {last_eval[k]:.3f}"
        lines.append(line)
    elif finished and last_eval:
        lines.append(f"test accuracy after step {step}: {last_eval['eval_accuracy']:.3f}")
    out = cfg.train.output_dir
    lines.append(f"metrics: {os.path.join(out, 'metrics.jsonl')}   TensorBoard: tensorboard --logdir {out}")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, ModelError, CheckpointError, FileNotFoundError, ImportError, SyncError,
            NonFiniteError) as e:
        print0(f"error: {e}", file=sys.stderr)
        distributed.finish(2, clean=False)
    except BaseException:                       # a bug or Ctrl-C: leave the group, show the traceback
        distributed.shutdown(clean=False)
        raise
    distributed.finish(0, clean=True)
