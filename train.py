"""RL fine-tuning with verifiable rewards: PSPO, GRPO, Dr. GRPO, RLOO, DAPO, REINFORCE++ and SPO in one visible loop.

    python train.py --config configs/grpo.yaml [--section.key=value ...]          # one process
    torchrun --nproc_per_node=N train.py --config configs/grpo.yaml               # FSDP2, N ranks
    python train.py --config X --plan [--gpus=8] [--gpu_gib=80]    # per-GPU memory plan, no GPU needed

Each step (docs/methods.md): sample B prompts (uniform epochs, or PPS §3) -> G completions each ->
rewards (§5) -> the sampler observes them (PPS: priorities; the importance weights) -> with DAPO's
dynamic sampling (§9), all-equal groups set aside and more rounds drawn the same way -> the group's reward
statistics, or ERS's (§2) -> the advantage method's token advantages (methods.py: GRPO / Dr. GRPO / RLOO
§1, REINFORCE++ and SPO in docs/related.md), with π_old / π_ref scored and the IS weights applied around
it -> num_iterations x (micro-batched clipped-surrogate loss with gradient accumulation, grad-norm clip,
AdamW step) -> engine sync -> log -> periodic eval -> periodic save. PSPO (§4) = ERS + PPS.

With rollout.mode=async (§7b) engine processes generate one step off: once the sampler has observed step
s, step s+1 is drawn and launched with θ_s (`Run.launch_next`), and the engines generate it while the
trainer computes step s's advantages and update; the IS correction turns the lag into the decoupled
objective. Sync and async run the same lines (engines/schedule.py: LocalRollouts, EngineRollouts).

How this departs from TRL's GRPOTrainer, on purpose:
- The loss is normalized over the whole optimizer step (every micro-batch and rank), so the
  gradient does not depend on how the batch is split (TRL normalizes per micro-batch).
- Sampling is counter-based (rollout.py): completions do not depend on the number of ranks.
- Dr. GRPO is the paper's (no std scaling, dr_grpo aggregation, β = 0), not a loss flag alone.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from pspo.dynamic_sampling import Draw, dynamic_sampling
from pspo.engines.vllm_engine import SyncError, load_policy_weights, stale_engine
from pspo.evaluation import evaluate
from pspo.methods import (Context, GroupBaseline, Method, MethodOutput, StepRollouts, group_baseline, method_for,
                          score_first, training_batch)
from pspo.offline.builtin import resolve_model_path
from pspo.priority_sampler import PrioritySampler
from pspo.released_sampler import ReleasedSampler
from pspo.related.prm import PRM, check_prm_path, load_prm, prm_metrics
from pspo.rewards import Score, gather_scores, reward_scorer, with_overlong_penalty, with_random_reward
from pspo.engines.process import EngineError
from pspo.engines.schedule import INFLIGHT, EngineRollouts, LocalRollouts, Sampling, engine_rollouts, pin_cores
from pspo.rollout import CountingEngine, build_engine, compile_enabled, engine_name
from pspo.sampler import UniformSampler, build_sampler, check_prompts_per_step, sampler_metrics, sampler_mode
from pspo.tasks.data import DataError, PromptSet, data_rows, prompt_sets
from pspo.tasks.reward_pool import RewardPool, resolve_workers
from pspo.training import checkpoint, distributed
from pspo.training.checkpoint import CheckpointError
from pspo.training.config import Config, ConfigError, load_config
from pspo.training.distributed import Dist, print0
from pspo.training.metrics import (AdvantageSums, MethodStats, MetricsLogger, RolloutSums, StepClock, UpdateSums,
                                   gpu_memory, step_metrics)
from pspo.training.lora import LoraError
from pspo.training.micro_batches import TokenRows, micro_batch_line, token_rows
from pspo.training.model import (ModelError, attention_heads, check_context, compile_line, load_model_config,
                                 load_tokenizer)
from pspo.training.packed_attention import choose_kernels
from pspo.training.optim import build_optimizer
from pspo.training.plan import plan_cli, startup_check
from pspo.training.run import (MAX_SKIPPED_IN_A_ROW, NonFiniteError, check_writable, every, last_step, load_models,
                               non_finite_error, open_folder, resume, summary, timings, trainable_line)
from pspo.update import policy_update


def main(argv: list[str]) -> None:
    if "--plan" in argv:                          # memory plan only: no GPU, no download (docs/gpu.md)
        print0(plan_cli(argv, resolve=resolve_model_path))
        return
    dist_ = distributed.init_distributed()
    if len(argv) < 2 or argv[0] != "--config":
        raise ConfigError("usage: train.py --config FILE.yaml [--section.key=value ...]")
    cfg = load_config(argv[1], argv[2:], dist_.world_size)
    torch.manual_seed(cfg.train.seed)
    run = setup(cfg, dist_)                       # every check that can refuse the run, then its folder
    r, method, B = cfg.rollout, run.method, cfg.train.prompts_per_step
    run.start()                                   # step 0: the test accuracy before training
    while run.step < cfg.train.max_steps:
        clock = StepClock()
        drawn = run.draw(0, B, clock)                   # B prompts, G completions each (async: launched a step ago)
        if r.dynamic_sampling:                          # DAPO (§9): all-equal groups set aside, more prompts drawn
            drawn = dynamic_sampling(drawn, lambda k, n: run.draw(k, n, clock), world=dist_.world_size,
                                     rank=dist_.rank, max_rounds=r.max_sampling_rounds,
                                     pad_id=run.tokenizer.pad_token_id, normalize=run.sampler.normalize)
            if not drawn.groups:                                                # none with a spread: no update
                if run.idle_step(clock, drawn):
                    break
                continue
        run.launch_next(clock)                          # async (§7b): step s+1 drawn, generated by θ_s meanwhile
        ctx = replace(run.context, mine=drawn.mine(dist_.rank, dist_.world_size))   # this rank's rows
        with clock("advantages_s"):
            rollouts = StepRollouts(step=run.step, indices=drawn.indices, rows=drawn.rows, seeds=drawn.seeds,
                                    rollout=drawn.rollout, scored=drawn.scored, rewards=drawn.rewards,
                                    is_weights=drawn.is_weights, inputs=run.token_rows(drawn.rows, drawn.rollout))
            if not method.generates:
                run.engine.release()                                            # nothing more to generate
            rollouts.old_logp, rollouts.ref_logp = score_first(method, rollouts, ctx)   # what the method reads
            rollouts.baseline = group_baseline(method, rollouts, ctx)           # (B,) its group's μ, s or ERS's
            out = method.estimate(rollouts, ctx)                                # (N, T) A, M
            if method.generates:
                run.engine.release()                                            # SPO: after its continuations
            batch, engine_gap = training_batch(out, rollouts, ctx)              # π_old, π_ref; A·w_PPS·w_IS
        with clock("update_s"):
            update = policy_update(run.policy, run.optimizer, run.scheduler, batch, cfg, dist_)
        run.step += 1
        with clock("sync_s"):
            sync = run.engine_after_update(drawn.rows)              # vLLM: the new weights loaded; async: staged
        if run.end_step(clock, output=out, baseline=rollouts.baseline, update=update, sync=sync,
                        engine_gap=engine_gap, sampling=drawn.metrics):
            break                                                               # the last step, or a stop signal
    run.close()


@dataclass(kw_only=True)
class Run:
    """A training run: what `setup` built, and the loop's progress."""
    cfg: Config
    dist: Dist
    tokenizer: PreTrainedTokenizerBase
    policy: torch.nn.Module
    ref: torch.nn.Module | None         # the frozen reference (algo.needs_reference)
    prm: PRM | None                     # PSPO*'s process reward model (reward.prm != 0, docs/related.md §C)
    train: PromptSet
    evals: PromptSet
    reward_pool: RewardPool
    score: Score                        # (train rows, texts) -> their rewards
    sampler: UniformSampler | PrioritySampler | ReleasedSampler
    method: Method
    context: Context                    # what the method and the calls around it read
    engine: CountingEngine              # the engine training generates with, counted (evaluation and sync: not)
    generation: LocalRollouts | EngineRollouts     # when and by which weights each step is generated (rollout.mode)
    separate_engine: bool               # the engine holds its own weights (vLLM): synced after each step
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    logger: MetricsLogger
    step: int                           # optimizer steps done (resumed: the checkpoint's)
    generated_tokens: float             # every token training generation returned, all ranks
    first_eval: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    skipped_in_a_row: int = 0           # non-finite updates in a row
    preemption: distributed.PreemptionSignal | None = None
    bar: tqdm | None = None

    def draw(self, round_: int, prompts: int, clock: StepClock) -> Draw:
        """One round of the step: `prompts` prompts from the sampler (uniform epochs, or PPS §3), this rank's
        share of them generated G times each, scored (§5; with reward.overlong_cache, DAPO's soft overlong
        punishment, §9), gathered (prompts, G) on every rank, and observed by the sampler (PPS: priorities;
        the importance weights). Round 0 draws the step's B prompts; a later round (dynamic sampling, §9)
        offsets its completions' prompt keys by round·B, so that their seeds differ from every other round's."""
        cfg, r = self.cfg, self.cfg.rollout
        with clock("bookkeeping_s"):
            if not self.generation.launched(self.step):                         # sync; async: a fresh run's step 0
                self.generation.launch(self.step, self.sampler.sample(prompts, same_step=round_ > 0),   # (P,) indices
                                     holds=self.step, round_=round_)
        with clock("gen_s"):                                                    # async: what the update did not hide
            drawn = self.generation.take(self.step)                             # this rank's share, G each
        indices, rows, seeds, rollout = drawn.indices, drawn.rows, drawn.seeds, drawn.rollout   # (P,) (N,) (N,)
        with clock("reward_s"):
            scored = self.score(rows, rollout.texts)                            # this rank's, (N,) each
            if cfg.reward.kind == "random":                                     # the control of §5
                scored = with_random_reward(scored, seeds, cfg.reward.random_rate, cfg.reward.accuracy)
            if cfg.reward.overlong_cache:                                       # + R_length (§9)
                scored = with_overlong_penalty(scored, rollout.mask.sum(1), r.max_new_tokens,
                                               cfg.reward.overlong_cache)
            rewards, accuracy = gather_scores(scored, r.num_generations)        # (P, G) each, every rank's
        with clock("bookkeeping_s"):
            is_weights = self.sampler.observe(indices, rewards, accuracy,       # PPS: priorities; (P, G) w
                                              normalized=not r.dynamic_sampling)   # (raw: §9's rounds)
        self.logger.log_prompts(self.step + 1, indices, accuracy, len(self.train.ids))   # prompts.jsonl
        return Draw(indices=indices, rows=rows, seeds=seeds, rollout=rollout, scored=scored, rewards=rewards,
                    is_weights=is_weights, metrics=sampler_metrics(self.sampler, cfg))   # of this draw

    def launch_next(self, clock: StepClock) -> None:
        """rollout.mode=async at lag 1: step s+1's prompts drawn from the sampler, which has just observed
        step s (so PPS and ERS see what they see in sync mode), and launched with θ_s: the engines generate
        them while the trainer updates on step s. Nothing after the last step; nothing in sync mode."""
        if self.generation.lag and self.step + 1 < self.cfg.train.max_steps:
            with clock("sync_s"):                                               # staging θ_s included
                self.generation.launch(self.step + 1, self.sampler.sample(self.cfg.train.prompts_per_step),
                                     holds=self.step)

    def token_rows(self, rows: list[int], rollout) -> TokenRows:
        """The step's completions after their train rows' prompts, as the model reads them."""
        return token_rows([self.train.ids[i] for i in rows], rollout.completion_ids, rollout.mask,
                          self.tokenizer.pad_token_id, self.dist.device)

    def start(self) -> None:
        """Step 0 of a fresh run: the test accuracy before training, logged; then stop signals are
        caught (SIGTERM / SIGUSR1) and the progress bar shown."""
        if self.evals.examples and self.step == 0:
            self.first_eval = self.last_eval = self.evaluate()
            self.logger.log(0, self.first_eval)
            print0(f"step 0: test accuracy {self.first_eval['eval_accuracy']:.3f} "
                   f"(greedy, {len(self.evals.examples)} problems)")
        self.preemption = distributed.PreemptionSignal()
        self.bar = tqdm(total=self.cfg.train.max_steps, initial=self.step,
                        disable=not (self.dist.is_main and self.cfg.train.progress))

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy (and mean@k with eval.num_samples) on the eval set, as logged metrics."""
        e = self.cfg.eval
        result = evaluate(self.engine.engine, self.evals.ids, self.evals.texts, self.evals.examples,
                          max_new_tokens=self.cfg.rollout.max_new_tokens, num_samples=e.num_samples,
                          temperature=e.temperature, top_p=e.top_p, seed=self.cfg.train.seed, dist_=self.dist,
                          batch_size=e.batch_size, timeout_s=self.cfg.reward.timeout_s,
                          progress=self.cfg.train.progress, pool=self.reward_pool)
        return {"eval_accuracy": result.pop("greedy_accuracy"), **{f"eval_{k}": v for k, v in result.items()}}

    def engine_after_update(self, rows: list[int]) -> dict[str, float]:
        """After the optimizer step, the engine's metrics. A separate engine wakes and loads the new weights,
        checked every rollout.sync_check_steps on the first four of this rank's prompts (`rows`: the train row
        of each completion, G per prompt; an idle step has none: then four of the train set's). Async: nothing
        is loaded here. The transformers engine is the policy itself: nothing to load."""
        if self.cfg.rollout.mode == "async":
            return self.generation.metrics()    # the weights were staged at launch (launch_next): its metrics
        if not self.separate_engine:
            return {}
        local = rows[::self.cfg.rollout.num_generations]                        # this rank's prompts
        if not local:                                   # an idle step (§9) trained none: this rank's of the train set
            local = list(range(self.dist.rank, len(self.train.ids), self.dist.world_size))
        check_ids = [self.train.ids[i] for i in local[:4]]
        return load_policy_weights(self.engine.engine, self.policy, check_ids, step=self.step, r=self.cfg.rollout,
                                   seed=self.cfg.train.seed, device=self.dist.device)

    def save(self, *, stopping: bool = False) -> None:
        """A checkpoint of the run. stopping (a stop signal): the step in flight is not waited for."""
        state = checkpoint.trainer_state(self.step, scheduler=self.scheduler, sampler=self.sampler,
                                         method_state=self.method.state, generated_tokens=self.generated_tokens,
                                         cfg=self.cfg, sampler_mode=sampler_mode(self.cfg))
        inflight = self.generation.in_flight(abandon=stopping)  # async, lag 1: the next step, answered or abandoned
        path = checkpoint.save_checkpoint(self.cfg.train.output_dir, self.step, policy=self.policy,
                                          tokenizer=self.tokenizer, optimizer=self.optimizer, trainer_state=state,
                                          dist_=self.dist, keep=self.cfg.train.keep_checkpoints,
                                          extra={INFLIGHT: inflight} if inflight else None)
        print0(f"saved {path}")

    def idle_step(self, clock: StepClock, drawn: Draw) -> bool:
        """A step that dynamic sampling left without a group with a spread (§9): no update (an optimizer step
        without gradients moves no weight; the learning-rate schedule advances as after any step), the
        engine released and synced, the step counted and logged (its means over trained completions null).
        Returns end_step's answer."""
        self.engine.release()
        with clock("update_s"):
            self.optimizer.zero_grad(set_to_none=True)
            for _ in range(self.cfg.algo.num_iterations):
                self.optimizer.step()                                           # AdamW skips gradient-less weights
                self.scheduler.step()
        self.step += 1
        with clock("sync_s"):
            sync = self.engine_after_update(drawn.rows)
        nothing = MethodStats(RolloutSums(**{f.name: 0.0 for f in fields(RolloutSums)}), AdvantageSums(0.0, 0.0, 0.0))
        update = UpdateSums(**{f.name: 0.0 for f in fields(UpdateSums)})
        return self.end_step(clock, output=MethodOutput(torch.zeros(0, 0), torch.zeros(0, 0), nothing),
                             baseline=None, update=update, sync=sync, engine_gap={}, sampling=drawn.metrics)

    def end_step(self, clock: StepClock, *, output: MethodOutput, baseline: GroupBaseline | None,
                 update: UpdateSums, sync: dict[str, float], engine_gap: dict[str, float],
                 sampling: dict[str, float]) -> bool:
        """The step's bookkeeping: a stale engine saves and stops the run; the non-finite updates in a
        row are counted; the step's metrics are assembled (summed over ranks), evaluated when due
        (timed apart from the step), logged and shown; the run is saved when due, stopped (saved) by
        too many non-finite updates, and True is returned when the run ends here: its last step (max_steps or
        the token budget, evaluated and saved) or a stop signal (saved)."""
        cfg, device = self.cfg, self.dist.device
        stale = stale_engine(sync, self.step)                                   # the engine's weights lag
        if stale is not None:
            self.save()
            raise stale
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if update.skipped_steps else 0
        counts, summed, metrics = step_metrics(output.stats, update, self.engine.take(), cfg, device)
        self.generated_tokens += counts.rollout_tokens + counts.mc_tokens
        metrics.update(output.metrics, **(baseline.metrics if baseline else {}), **engine_gap, **sampling, **sync,
                       **gpu_memory(device), **prm_metrics(self.prm, device, clock.elapsed()))
        metrics.update(timings(clock, summed.update_tokens), generated_tokens=self.generated_tokens,
                       lr=self.scheduler.get_last_lr()[0])
        last = last_step(cfg, self.step, self.generated_tokens)                # max_steps or the token budget
        if self.evals.examples and (last or every(self.step, cfg.train.eval_steps)):
            with clock("eval_s"):
                self.last_eval = self.evaluate()
            metrics.update(self.last_eval, eval_s=clock.times["eval_s"])
        self.logger.log(self.step, metrics)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                             step_s=f"{metrics['step_time_s']:.2f}")
        stopping = self.preemption.requested(device)                            # the scheduler's warning
        failing = self.skipped_in_a_row == MAX_SKIPPED_IN_A_ROW
        if last or every(self.step, cfg.train.save_steps) or stopping or failing:
            self.save(stopping=stopping)
        if failing:
            raise non_finite_error(self.step)
        if not stopping:
            return last
        print0(f"{self.preemption.name or 'a stop signal'} received: stopped after step {self.step} "
               "with a checkpoint; continue with --train.resume=auto")
        return True

    def close(self) -> None:
        self.bar.close()
        self.logger.close()
        self.reward_pool.close()                       # on an error too, when collected (reward_pool.py)
        self.generation.close()                        # the engine processes (on an error too, when collected)
        if self.separate_engine:
            self.engine.engine.close()                 # vLLM: its adapter folder, before a rank's os._exit
        print0(summary(self.cfg, self.step, self.generated_tokens, self.first_eval, self.last_eval,
                       len(self.evals.examples)))


def setup(cfg: Config, dist_: Dist) -> Run:
    """The run's parts, in an order where a mistake is found before anything slow: the checks that need
    no model (the output folder, the checkpoint to resume, the engine, the data, PPS's batch, the PRM's
    folder) come before a model is built or loaded; those that need its tokenizer alone (the context, the
    prompts, the sampler) before its weights; the start-up lines once every load has passed (the weights,
    the checkpoint resumed), so that a refusal is the only line; and every check that can refuse the run
    (also the memory plan, the PRM) before anything is written to its folder (training/run.py: open_folder)."""
    m, r, out = cfg.model, cfg.rollout, cfg.train.output_dir
    check_writable(out, "train.output_dir", folder=True)
    cores = pin_cores(r.engine_cores)                                       # async on CPU: the trainer's cores
    resume_from = checkpoint.resolve_resume(cfg, sampler_mode(cfg))        # its trainer state read, checked
    kind = engine_name(r.engine)                                            # vLLM not installed: refused here
    engine = "hf" if r.mode == "async" else kind    # async: the engine processes run kind; evaluation runs hf here
    rows = data_rows(cfg)                                                   # read, their golds checked
    check_prompts_per_step(cfg, len(rows[0].usable), cfg.data.train)
    check_prm_path(cfg)
    if dist_.is_main:
        resolve_model_path(m.name_or_path)                                  # builds a builtin model once
    distributed.barrier()
    base_path = resolve_model_path(m.name_or_path)
    reward_pool = RewardPool(resolve_workers(cfg.reward.workers, torch.get_num_threads()))   # starts now
    tokenizer = load_tokenizer(base_path, m.trust_remote_code)
    model_config = load_model_config(base_path, m.trust_remote_code)
    check_context(model_config, cfg.data.max_prompt_tokens, r.max_new_tokens)
    train, evals = prompt_sets(cfg, tokenizer, rows)
    sampler = build_sampler(cfg, [ex.problem for ex in train.examples], cfg.data.train)   # uniform or PPS
    plan_line, checkpointing = startup_check(cfg, base_path, dist_.world_size, dist_.device, kind,
                                             resolve=resolve_model_path)  # PlanError: cannot fit; auto resolved
    t = cfg.train
    kernels = choose_kernels(t.attention, device=dist_.device, bf16=m.bf16,     # probed; ConfigError: refused
                             **attention_heads(model_config))
    prm = load_prm(cfg, dist_.device)
    policy, ref = load_models(cfg, dist_, resume_from or base_path, base_path, kernels, checkpointing)
    # FSDP ranks generating with the policy itself must run the same forward passes (spo.py pads)
    lockstep = dist_.world_size > 1 and engine == "hf"
    problems = [ex.problem for ex in train.examples]
    method = method_for(cfg, train.ids, tokenizer.pad_token_id, dist_, lockstep, problems)   # the one choice of method
    optimizer, scheduler = build_optimizer(policy, cfg)
    step, generated_tokens = 0, 0.0
    if resume_from:
        step, generated_tokens = resume(resume_from, cfg=cfg, dist_=dist_, policy=policy, optimizer=optimizer,
                                        scheduler=scheduler, sampler=sampler, method_state=method.state,
                                        sampler_mode=sampler_mode(cfg))
    # every load has passed (weights, tokenizer, checkpoint): a refusal is the run's only line
    print0("\n".join([plan_line, micro_batch_line(t.micro_batch_size, t.micro_batch_tokens, t.packing, kernels),
                      compile_line(t.compile, m.logprob_head, dist_.device), trainable_line(policy, m.lora)]
                     + ([f"resumed from {resume_from} at step {step}"] if resume_from else [])))
    weights = base_path if m.lora.rank or not resume_from else resume_from        # LoRA: the base + adapter
    max_prompt_len = max(len(p) for p in train.ids + evals.ids)
    built = build_engine(replace(r, engine=engine), policy, weights, tokenizer, max_prompt_len=max_prompt_len,
                          seed=cfg.train.seed, world_size=dist_.world_size, bf16=m.bf16)
    counter = CountingEngine(built)
    sampling = Sampling(seed=cfg.train.seed, step_prompts=cfg.train.prompts_per_step, G=r.num_generations,
                        temperature=r.temperature, top_p=r.top_p, max_new_tokens=method.max_new_tokens)
    if r.mode == "async":                       # engine processes, one step off: started and ready, or refused
        schedule = engine_rollouts(cfg, dist_, policy=policy, model_path=base_path, train_ids=train.ids,
                                   sampling=sampling, count=lambda rollout: counter.count(rollout, prefix=False),
                                   kind=kind, max_len=max_prompt_len + r.max_new_tokens,
                                   cores=cores, compile=compile_enabled(r.compile, dist_.device), resumed=resume_from)
    else:
        schedule = LocalRollouts(counter.generate, train.ids, sampling, dist_.rank, dist_.world_size)
    score = reward_scorer(cfg.reward, train, reward_pool, prm)
    B_local = cfg.train.prompts_per_step // dist_.world_size
    context = Context(cfg=cfg, policy=policy, ref=ref, engine=counter, train_ids=train.ids, problems=problems,
                      dist=dist_, mine=slice(dist_.rank * B_local, (dist_.rank + 1) * B_local),
                      lockstep=lockstep, score=score, distinct_problems=len(set(problems)),
                      state=method.state)
    logger = open_folder(cfg, dist_, step)                 # the first write: nothing can refuse it now
    return Run(cfg=cfg, dist=dist_, tokenizer=tokenizer, policy=policy, ref=ref, prm=prm, train=train,
               evals=evals, reward_pool=reward_pool, score=score, sampler=sampler, method=method,
               context=context, engine=counter, generation=schedule, separate_engine=engine == "vllm",
               optimizer=optimizer, scheduler=scheduler, logger=logger, step=step, generated_tokens=generated_tokens)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, ModelError, CheckpointError, LoraError, FileNotFoundError, ImportError,
            SyncError, NonFiniteError, EngineError) as e:
        print0(f"error: {e}", file=sys.stderr)
        distributed.finish(2, clean=False)
    except distributed.PeerError as e:          # rank 0's bug, seen from another rank: rank 0 shows the traceback
        print(f"error: rank 0 failed: {e}", file=sys.stderr)
        distributed.finish(1, clean=False)
    except BaseException:                       # a bug or Ctrl-C: leave the group, show the traceback
        distributed.shutdown(clean=False)
        raise
    distributed.finish(0, clean=True)
