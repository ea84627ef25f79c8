"""The memory plan (pspo/training/plan.py): hand-worked static parts, the activation and log-prob estimates
against what PyTorch really saves / allocates on CPU, the `--plan` command and the start-up check."""
import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

from pspo.offline.builtin import resolve_model_path
from pspo.training import plan
from pspo.training.config import LoraConfig, load_config
from pspo.training.token_logprobs import token_logprobs
from pspo.engines.decode import bucket
from pspo.training.plan import GiB, PlanError


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN = os.path.join(ROOT, "configs", "qwen2.5-math-1.5b")
RECIPE = os.path.join(QWEN, "pspo.yaml")
# LiveBytes (the peak of the storages allocated inside it) is bench/logprob_head.py's, which measures
# the log-prob head the same way
_spec = importlib.util.spec_from_file_location("logprob_head", os.path.join(ROOT, "bench", "logprob_head.py"))
logprob_head = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(logprob_head)
LiveBytes = logprob_head.LiveBytes


def small_config(**kw) -> Qwen2Config:
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True, max_position_embeddings=4096)
    return Qwen2Config(**{**fields, **kw})


def test_static_parts_hand_worked():
    # hidden 64, 4 heads x 16, 2 KV heads (32 wide), MLP 128, vocab 100, tied embeddings. One layer:
    # q 64*64+64 = 4160, k and v 64*32+32 = 2080 each, o 64*64 = 4096, MLP 3*64*128 = 24576,
    # two norms 128 -> 37120. Root: embeddings 100*64 + final norm 64 = 6464. All: 2*37120 + 6464 = 80704.
    a = plan.arch_from_config(small_config())
    assert (a.layer_params, a.root_params, a.params) == (37120, 6464, 80704)
    cfg = load_config(None, ["--algo.beta=0", "--rollout.engine=hf", "--train.prompts_per_step=8"], 4)
    rows = {key: b for key, _, b, _ in plan.make_plan(cfg, a, gpus=4, gpu_bytes=80 * GiB, engine="hf").rows}
    # over 4 GPUs: params 4*80704/4 = 80704 B, grads the same, AdamW 2 x that = 161408;
    # FSDP2 in flight: root param + grad, 2 layers + 1 layer grad, fp32: 4*(2*6464 + 3*37120) = 497152
    assert (rows["params"], rows["grads"], rows["adam"], rows["fsdp"]) == (80704, 80704, 161408, 497152)
    assert "ref" not in rows                                            # β = 0: no reference model


def test_qwen_recipe_static_numbers():
    # Qwen2.5-Math-1.5B (the stand-in config.json): 1,543,714,304 parameters; KV per token in bf16:
    # 2 (K, V) x 28 layers x 2 KV heads x 128 x 2 B = 28672. vLLM at 0.3 x 80 GiB = 24 GiB, minus bf16
    # weights 2 x 1543714304 B = 2.875 GiB -> 22682375168 B of KV / (28672 x 4096 B per sequence) = 193.1.
    a, source = plan.load_arch("Qwen/Qwen2.5-Math-1.5B", RECIPE)
    assert a.params == 1_543_714_304 and "model_config.json" in source
    assert plan.kv_bytes_per_token(a) == 28672
    cfg = load_config(RECIPE, ["--data.max_prompt_tokens=512", "--rollout.max_new_tokens=3584"], 8)
    p = plan.make_plan(cfg, a, gpus=8, gpu_bytes=80 * GiB, engine="vllm")
    assert any("holds 193 sequences of 4096 tokens" in n for n in p.notes)
    assert dict((k, b) for k, _, b, _ in p.rows)["vllm"] == 24 * GiB


@functools.lru_cache(maxsize=1)
def real_width_model() -> Qwen2Model:
    """One decoder layer of Qwen2.5-Math-1.5B's width (random weights), built once."""
    torch.manual_seed(0)
    config = Qwen2Config.from_pretrained(os.path.join(QWEN, "model_config.json"))
    config.num_hidden_layers, config.vocab_size, config._attn_implementation = 1, 1000, "sdpa"
    return Qwen2Model(config).train()


def measure_saved(bf16: bool, checkpointing: bool, b: int = 2, s: int = 256) -> tuple[int, int, plan.Arch]:
    """(activation bytes, bf16 weight-copy bytes) the model saves for backward: unique storages, not params."""
    model = real_width_model()
    config = model.config
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    ids = torch.randint(0, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(b, s, dtype=torch.long)
    attention[1, :40] = 0                                     # left padding: sdpa gets a mask, as in training
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    activations, copies = {}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() in params:
            return t
        # a math-path sdpa would save (b, heads, s, s) probabilities, which the GPU kernels never keep
        if t.dim() == 4 and t.shape[1] == config.num_attention_heads and t.shape[-2:] == (s, s):
            return t
        kind = copies if tuple(t.shape) in weight_shapes else activations     # autocast's cast of a weight
        kind[storage.data_ptr()] = storage.nbytes()
        return t
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0))
    arch = plan.Arch(config.hidden_size, config.intermediate_size, 1, config.num_attention_heads,
                     config.num_key_value_heads, 128, 1000, sum(p.numel() for p in model.parameters()),
                     sum(p.numel() for p in model.layers[0].parameters()))
    return sum(activations.values()), sum(copies.values()), arch


@pytest.mark.parametrize("bf16", [True, False])
def test_activation_estimate_matches_saved_tensors(bf16):
    # hidden 1536, MLP 8960, 12 heads, 2 KV heads; 2 x 256 tokens. bf16, per token and layer:
    # 26*1536 + 8*1536 + 8*8960 + 2*256 + 4*12 + 8 = 124472 B (fp32: 24H + 16H + 16I + 4s + 56 = 205880 B);
    # the head adds the final norm 8*1536, RoPE cos/sin 8*128 and the boolean mask 256 = 13568 B per token.
    b, s = 2, 256
    acts, copies, arch = measure_saved(bf16, checkpointing=False)
    acts_ckpt, copies_ckpt, _ = measure_saved(bf16, checkpointing=True)
    weight_copies = 2 * arch.layer_params if bf16 else 0                 # 2 B x 46.8M (biases are not saved)
    per_token = (124472 if bf16 else 205880) + 13568
    shape = dict(micro=b, seq=s, completion=0, bf16=bf16)
    assert plan.saved_bytes(arch, **shape, checkpointing=False) == b * s * per_token + weight_copies
    predicted = plan.saved_bytes(arch, **shape, checkpointing=False) - weight_copies
    assert abs(predicted / acts - 1) < 0.25, (predicted, acts)
    if bf16:
        assert abs(weight_copies / copies - 1) < 0.25, (weight_copies, copies)
    # checkpointed: the layer's fp32 input (4H per token) and the head only, no weight copies saved
    predicted_ckpt = plan.saved_bytes(arch, **shape, checkpointing=True)
    assert abs(predicted_ckpt / acts_ckpt - 1) < 0.25 and copies_ckpt == 0, (predicted_ckpt, acts_ckpt)
    # and at its peak one layer's recompute: at least what that layer saves without checkpointing
    layer_measured = acts - acts_ckpt + b * s * 4 * arch.hidden + copies
    extra = plan.activation_peak(arch, **shape, checkpointing=True) - predicted_ckpt
    assert extra >= 0.75 * layer_measured, (extra, layer_measured)


def test_logprob_chunk_estimate_matches_allocations():
    # chunks of 256 tokens x vocab 32768 in float32 = 32 MiB a block; the head's gradient 32768 x 128 x 4 = 16 MiB.
    # Estimate: forward 2 x 32 = 64 MiB, backward 32 + 16 = 48 MiB -> 64 MiB.
    # bf16: forward 64 + 2 x 4 MiB (W in bf16) = 72; backward 32 x 1.5 + 10 x 4 = 88 MiB -> 88 MiB.
    torch.manual_seed(0)
    V, H, chunk = 32768, 128, 256
    weight = torch.nn.Parameter(torch.randn(V, H) * 0.02)
    hidden = torch.randn(2, 256, H, requires_grad=True)
    targets = torch.randint(0, V, (2, 256))
    with LiveBytes() as live:
        logp, _ = token_logprobs(hidden, weight, targets, 0.7, chunk)
        logp.sum().backward()
    a = plan.Arch(H, 4 * H, 1, 2, 2, H // 2, V, 0, 0)
    assert plan.logprob_chunk_bytes(a, chunk) == 64 * 2**20
    assert plan.logprob_chunk_bytes(a, chunk, bf16=True) == 88 * 2**20
    assert abs(plan.logprob_chunk_bytes(a, chunk) / live.peak - 1) < 0.25, live.peak


def test_check_fits_and_startup_on_cpu(tmp_path, monkeypatch):
    small_config().save_pretrained(tmp_path)
    cfg = load_config(None, ["--train.prompts_per_step=8"], 1)
    a = plan.arch_from_config(small_config())
    # 1 MiB: the 2 GiB overhead alone exceeds it
    too_small = plan.make_plan(cfg, a, gpus=1, gpu_bytes=2**20, engine="hf")
    assert not too_small.fits and "does not fit" in too_small.verdict()
    with pytest.raises(PlanError) as e:
        plan.check_fits(too_small, cfg)
    assert "\n" not in str(e.value) and "train.micro_batch_size" in str(e.value)
    plan.check_fits(plan.make_plan(cfg, a, gpus=1, gpu_bytes=80 * GiB, engine="hf"), cfg)      # fits: no error
    monkeypatch.setattr(plan, "host_memory", lambda: 2**20)
    # CPU: printed, never stops
    line = plan.startup_check(cfg, str(tmp_path), 1, torch.device("cpu"), "hf", resolve=resolve_model_path)
    assert "does not fit" in line and "not enforced" in line and "\n" not in line


def test_vllm_share_too_small_to_start():
    cfg = load_config(RECIPE, [], 8)
    a, _ = plan.load_arch(cfg.model.name_or_path, RECIPE)
    p = plan.make_plan(cfg, a, gpus=8, gpu_bytes=8 * GiB, engine="vllm")      # 0.3 x 8 GiB < 2.9 GiB of weights
    assert p.blocker and not p.fits


def run_plan(*args: str, home: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1"}      # empty cache: nothing to find or download
    return subprocess.run([sys.executable, "train.py", "--config", RECIPE, "--plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_plan_cli_on_the_recipe(tmp_path):
    out = tmp_path / "run"
    text = plan.plan_cli(["--config", RECIPE, "--plan", f"--train.output_dir={out}"],
                         resolve=resolve_model_path)
    for row in ("parameters (fp32, 1/8)", "AdamW", "activations", "log-prob head", "vLLM", "total: update"):
        assert row in text
    assert "verdict: peak" in text and "fits" in text and "does not fit" not in text
    proc = run_plan("--gpu_gib=1", f"--train.output_dir={out}", home=str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert "verdict:" in proc.stdout and "does not fit" in proc.stdout
    assert not out.exists()                                             # a plan writes nothing


@pytest.mark.slow
def test_plan_cli_bad_model_path(tmp_path):
    proc = run_plan("--model.name_or_path=/no/such/model", home=str(tmp_path))
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "model.name_or_path" in lines[0], lines


@pytest.mark.slow
def test_plan_cli_another_hub_model_does_not_borrow_the_recipes_stand_in(tmp_path):
    # The recipe folder's model_config.json describes Qwen2.5-Math-1.5B only: a 70B model that is
    # not in the local cache must not be planned (and declared to fit) with the 1.5B architecture.
    proc = run_plan("--model.name_or_path=meta-llama/Llama-3.1-70B", home=str(tmp_path))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "meta-llama/Llama-3.1-70B" in lines[0], lines
    assert "fits" not in proc.stdout


def test_plan_cli_7b_knights_preset_and_space_separated_gpus():
    # Qwen2.5-7B-Instruct-1M (7.6B parameters) with the reference code's batch: on 8 GPUs of 80 GiB it fits
    # only because vLLM sleeps during the update (its 0.3 x 80 = 24 GiB is freed); on 1 GPU the
    # whole 7.6B x 16 bytes of fp32 params + grads + AdamW (113 GiB) alone does not fit.
    preset = "configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml"
    text = plan.plan_cli(["--config", preset, "--plan"], resolve=resolve_model_path)
    assert "7.616B parameters" in text and "asleep in update" in text
    assert "fits" in text and "does not fit" not in text
    one = plan.plan_cli(["--config", preset, "--plan", "--gpus", "1"],          # "--gpus 1" == "--gpus=1"
                        resolve=resolve_model_path)
    assert "on 1 GPUs" in one and "does not fit" in one
    assert one == plan.plan_cli(["--config", preset, "--plan", "--gpus=1"], resolve=resolve_model_path)


def test_step_shape_counts_what_each_method_generates():
    # 2 prompts per GPU, prompts up to 16 tokens, T = 32 new tokens, G = 2.
    base = ["--data.max_prompt_tokens=16", "--rollout.max_new_tokens=32", "--rollout.num_generations=2",
            "--train.prompts_per_step=2", "--algo.beta=0"]

    def calls(extra):
        return [(c.inputs, c.n, c.longest) for c in plan.step_shape(load_config(None, base + extra, 1), 2).calls]
    # GRPO: one call, 2 prompts x G = 2, rows of 16 + 32 = 48 tokens
    assert calls([]) == [(2, 2, 48)]
    # SPO-chain, K = 8, N = 3: at most ceil(32 / 8) = 4 cuts per completion -> 2 x 2 x 4 = 16 states,
    # 3 continuations each; a padded chunk row holds up to 16 + 31 (longest prefix) + 32 (budget after
    # the shortest, empty one) = 79 tokens. Per prompt: G (1 + 4 N) = 2 x 13 = 26 sequences.
    chain = calls(["--algo.advantage=spo_chain", "--spo.cutpoint_interval=8", "--spo.num_mc=3"])
    assert chain == [(2, 2, 48), (16, 3, 79)] and sum(i * n for i, n, _ in chain) == 2 * 26
    # K = 5: ceil(32 / 5) = 7 cuts -> 28 states
    assert calls(["--algo.advantage=spo_chain", "--spo.cutpoint_interval=5", "--spo.num_mc=3"])[1][0] == 28
    # SPO-tree 2,3,4 with M = 8: depth 0 2 x 2 rows of 16 + 8 = 24; depth 1 4 nodes x 3 to 16 + 16 = 32;
    # depth 2 12 nodes x 4 to 48. Per prompt 2 x 3 x 4 = 24 at once, 2 + 6 + 24 = 32 in all.
    tree = calls(["--algo.advantage=spo_tree", "--spo.branching=2,3,4", "--spo.segment_tokens=8"])
    assert tree == [(2, 2, 24), (4, 3, 32), (12, 4, 48)] and sum(i * n for i, n, _ in tree) == 2 * 32
    # the update trains the 2 x G = 4 completions (GRPO, SPO-chain); SPO-tree its drawn edges, at most
    # train.micro_batch_size = 3 rows
    rows = {name: plan.step_shape(load_config(None, base + extra + ["--train.micro_batch_size=3"], 1), 2).update_rows
            for name, extra in (("grpo", []), ("chain", ["--algo.advantage=spo_chain"]),
                                ("tree", ["--algo.advantage=spo_tree", "--spo.branching=2,3,4",
                                          "--spo.segment_tokens=8"]))}
    assert rows == {"grpo": 4, "chain": 4, "tree": 3}


def test_bucket_hand_worked():
    # the ladder of 96: 96, 48, 24, 12, 6, 3, 2, 1 (each ceil(half) of the last); of 12: 12, 6, 3, 2, 1
    assert [bucket(n, 96) for n in (1, 2, 3, 5, 36, 48, 49, 96)] == [1, 2, 3, 6, 48, 48, 96, 96]
    assert [bucket(n, 12) for n in (4, 7, 12, 16)] == [6, 12, 12, 16]                # above the top: itself


def test_static_cache_counts_buckets_and_spo_continuations():
    # small_config: 2 layers x 2 KV heads x 16; float32 (model.bf16 false): K and V 4 B each ->
    # 2 x 2 x 2 x 16 x 4 = 512 B per position; the sampler's 8 float32 blocks of vocab 100: 3200 B per row.
    # rollout.batch_size 12: HFEngine.generate runs max(1, 12 // n) inputs x n rows at once, padded to the
    # ladder 12, 6, 3, 2, 1; the cache block is max_prompt_tokens + max_new_tokens = 16 + 32 = 48 positions.
    a = plan.arch_from_config(small_config())
    base = ["--data.max_prompt_tokens=16", "--rollout.max_new_tokens=32", "--rollout.num_generations=2",
            "--train.prompts_per_step=2", "--algo.beta=0", "--rollout.engine=hf", "--rollout.batch_size=12",
            "--model.bf16=false", "--data.eval="]

    def generate_rows(extra, gpus=1):
        cfg = load_config(None, base + extra, gpus)
        return {k: (b, ph) for k, _, b, ph in plan.make_plan(cfg, a, gpus=gpus, gpu_bytes=80 * GiB, engine="hf").rows}
    # GRPO: min(2, 6) x 2 = 4 rows -> bucket 6; 48 positions: 512 x 6 x 48 = 147456 B, kept in both phases;
    # the sampler 6 x 3200 = 19200 B during generation; float32: no weight copies
    rows = generate_rows([])
    assert rows["kvcache"] == (147456, "both") and rows["generate"] == (19200, "generation")
    assert "copies" not in rows
    # with the evaluation (builtin:arithmetic, eval.batch_size 256, greedy): min(256, 12) x 1 = 12 rows
    # -> 512 x 12 x 48 = 294912
    assert generate_rows(["--data.eval=builtin:arithmetic"])["kvcache"][0] == 294912
    # SPO-chain K = 8, N = 3: 16 states in chunks of 12 // 3 = 4 -> 12 rows of up to 79 positions, i.e.
    # 2 blocks = 96: 512 x 12 x 96 = 589824; the sampler 12 x 3200 = 38400
    chain = generate_rows(["--algo.advantage=spo_chain", "--spo.cutpoint_interval=8", "--spo.num_mc=3"])
    assert chain["kvcache"][0] == 589824 and chain["generate"][0] == 38400
    # SPO-tree 2,3,4, M = 8: depth 2 has 12 nodes in chunks of 12 // 4 = 3 -> 12 rows of 48: 294912
    tree = ["--algo.advantage=spo_tree", "--spo.branching=2,3,4", "--spo.segment_tokens=8"]
    assert generate_rows(tree)["kvcache"][0] == 294912
    # a branching above batch_size: chunks of max(1, 12 // 16) = 1 input, still 16 rows: 512 x 16 x 48
    wide = ["--algo.advantage=spo_tree", "--spo.branching=2,3,16", "--spo.segment_tokens=8"]
    assert generate_rows(wide)["kvcache"][0] == 393216
    # bf16: 2 B per value -> half the cache, 147456 / 2 = 73728, and the bf16 copies 2 x 80704 = 161408 B
    rows = generate_rows(["--model.bf16=true"])
    assert rows["kvcache"][0] == 73728 and rows["copies"] == (161408, "both")
    # 2 GPUs (prompts_per_step 4, 2 each): `generate` on the sharded policy, during generation only:
    # KV (8 B per value) and sampler of 4 rows x 48: 4 x (48 x 512 + 3200) = 111104, plus the gathered
    # root and 2 layers, 4 x (6464 + 2 x 37120) = 322816 -> 433920
    rows = generate_rows(["--train.prompts_per_step=4"], gpus=2)
    assert rows["generate"] == (433920, "generation") and "kvcache" not in rows


def test_vllm_note_counts_the_tree_at_once():
    # The 1.5B SPO-tree recipe (6,6,6) on 8 GPUs: 1 prompt per GPU; per step 6 + 36 + 216 = 258
    # sequences, 216 submitted in the last call; 193 fit in the KV cache (test_qwen_recipe_static_numbers).
    recipe = os.path.join(QWEN, "spo_tree.yaml")
    cfg = load_config(recipe, ["--data.max_prompt_tokens=512", "--rollout.max_new_tokens=3584"], 8)
    a, _ = plan.load_arch(cfg.model.name_or_path, recipe)
    notes = plan.make_plan(cfg, a, gpus=8, gpu_bytes=80 * GiB, engine="vllm").notes
    assert any("holds 193 sequences" in n and "generates 258 per GPU, up to 216 in one call (in waves)" in n
               for n in notes), notes


def test_allocator_cache_term_hand_worked():
    # test_static_parts_hand_worked's 4-GPU plan: the allocator row is 0.2 x the larger phase's tensors,
    # every row but the constant (and vLLM's share, absent with hf); the constant stays 2 GiB.
    a = plan.arch_from_config(small_config())
    cfg = load_config(None, ["--algo.beta=0", "--rollout.engine=hf", "--train.prompts_per_step=8"], 4)
    p = plan.make_plan(cfg, a, gpus=4, gpu_bytes=80 * GiB, engine="hf")
    rows = {key: (b, ph) for key, _, b, ph in p.rows}
    tensors = {phase: sum(b for key, (b, ph) in rows.items() if key not in ("allocator", "overhead")
                          and ph in ("both", phase)) for phase in ("generation", "update")}
    assert rows["allocator"] == (int(0.2 * max(tensors.values())), "both")
    assert rows["overhead"] == (2 * GiB, "both")
    assert p.peak == max(tensors.values()) + int(0.2 * max(tensors.values())) + 2 * GiB


def test_plan_bounds_the_measured_reserved_peak_of_the_1_5b_recipe():
    # the GPU check's grpo15 section (now `recipe`) on one H100 (79.2 GiB): grpo.yaml, 512 new tokens, transformers
    # `generate` (before the static-cache loop), fixed micro-batches of 4 rows. The plan's tensors then
    # (the update): params 5.75 + grads 5.75 + AdamW 11.50 + reference 5.75 + activations 3.16 + log-prob
    # head 3.91 (bf16: 1.5 x one 2048 x 151936 fp32 block of 1.16 GiB + 10 x V x H bytes = 2.17)
    # = 35.83 GiB; with the 2 GiB constant 37.83, below the 43.0 GiB torch.cuda.max_memory_reserved
    # measured (with a float32 log-prob head).
    # The static-cache loop keeps two more terms in both phases: its bf16 weight copies, 2 x 1543714304 B
    # = 2.875 GiB, and its KV cache. Rows: training 8 prompts x 6 = 48 (bucket 48 of rollout.batch_size 96),
    # the greedy evaluation min(eval.batch_size 64, 96) = 64 -> bucket 96; positions 512 + 512 = 1024;
    # bf16: 2 x 28 layers x 2 KV heads x 128 x 2 B = 28672 B x 96 x 1024 = 2.625 GiB.
    # Tensors 35.83 + 2.875 + 2.625 = 41.33 GiB; allocator cache 0.2 x 41.33 = 8.27 -> peak 51.60 GiB.
    cfg = load_config(os.path.join(QWEN, "grpo.yaml"), ["--rollout.engine=hf", "--rollout.max_new_tokens=512",
                                                        "--train.micro_batch_tokens=0"], 1)   # as measured: 4 rows
    a, _ = plan.load_arch(cfg.model.name_or_path, os.path.join(QWEN, "grpo.yaml"))
    p = plan.make_plan(cfg, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="hf")
    rows = {key: b for key, _, b, _ in p.rows}
    assert rows["kvcache"] == 28672 * 96 * 1024 and rows["copies"] == 2 * 1543714304
    tensors = p.phase_bytes("update") - rows["allocator"] - rows["overhead"]
    assert abs(tensors / GiB - 41.33) < 0.01 and abs(rows["allocator"] / GiB - 8.27) < 0.01
    assert p.peak / GiB >= 43.0 and abs(p.peak / GiB - 51.60) < 0.01
    # The configuration as measured, without the static-cache terms: 35.83 GiB of tensors; the allocator
    # row 0.2 x 35.83 = 7.17 lifts the bound from 37.83 (under the measured 43.0) to 45.00 (over it).
    measured = tensors - rows["kvcache"] - rows["copies"]
    assert abs(measured / GiB - 35.83) < 0.01
    assert (measured + rows["overhead"]) / GiB < 43.0 <= (1.2 * measured + rows["overhead"]) / GiB
    assert plan.ALLOCATOR_SLACK == 0.2


WANT = {"dr_grpo.yaml": 53248, "spo_tree.yaml": 16384, "pspo_star.yaml": 32768, "pspo_lora.yaml": 114688}


@pytest.mark.parametrize("config, gpus, gib", [("configs/qwen2.5-math-1.5b/grpo.yaml", 1, 79.2),
                                               ("configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml", 8, 80.0)])
def test_gpu_recipes_use_the_largest_token_budget_the_plan_fits(config, gpus, gib):
    # 1.5B on one H100 (79.2 GiB), vLLM awake in the update: with 9 sequences of 512 + 3584 = 4096
    # tokens (36864) the update totals 79.1 GiB or less, with 10 it does not fit; the 7B on 8 GPUs:
    # 8 sequences of 512 + 4096 = 4608 (36864), all the 8 rows a GPU trains per step (a larger
    # budget changes nothing there).
    cfg = load_config(config, [], gpus)
    a, _ = plan.load_arch(cfg.model.name_or_path, config)
    budget = plan.largest_token_budget(cfg, a, gpus=gpus, gpu_bytes=int(gib * GiB), engine="vllm")
    assert cfg.train.micro_batch_tokens == budget == 36864
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if gpus == 1:
        more = load_config(config, [f"--train.micro_batch_tokens={budget + seq}"], gpus)
        assert not plan.make_plan(more, a, gpus=gpus, gpu_bytes=int(gib * GiB), engine="vllm").fits
        # each 1.5B recipe sets the largest budget for itself: Dr. GRPO has no reference model, 13
        # sequences fit (53248); SPO-tree's plan counts micro_batch_size (4) edges at once (16384); the
        # PSPO* recipe also holds its PRM on the GPU: with a BERT-base-sized one (110M parameters, hidden
        # 768, MLP 3072) 9 sequences no longer fit (79.3 GiB), 8 do (32768); LoRA's frozen bf16 base
        # (no master copy, gradient, AdamW state or reference) leaves room for 28 (114688); the others
        # inherit 36864
        bert = plan.PRMArch(110_000_000, 768, 3072)
        for name in sorted(os.listdir(QWEN)):
            if name.endswith(".yaml"):
                recipe = load_config(os.path.join(QWEN, name), [], 1)
                prm = bert if recipe.reward.prm else None
                assert recipe.train.micro_batch_tokens == plan.largest_token_budget(
                    recipe, a, gpus=1, gpu_bytes=int(gib * GiB), engine="vllm", prm=prm) == WANT.get(name, budget), name
                assert plan.make_plan(recipe, a, gpus=1, gpu_bytes=int(gib * GiB), engine="vllm", prm=prm).fits, name


def test_the_7b_lora_preset_fits_one_gpu_at_its_largest_budget():
    # LoRA on the 7B: a frozen bf16 base (15.2 GB), rank-16 adapters with their fp32 state, no reference
    # copy: one 80 GB GPU holds it where full fine-tuning needs 8 (reinforce_pp.yaml)
    config = "configs/qwen2.5-7b-instruct-1m/reinforce_pp_lora.yaml"
    cfg = load_config(config, [], 1)
    a, _ = plan.load_arch(cfg.model.name_or_path, config)
    assert cfg.train.micro_batch_tokens == plan.largest_token_budget(cfg, a, gpus=1, gpu_bytes=int(79.2 * GiB),
                                                                     engine="vllm") == 55296
    assert plan.make_plan(cfg, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="vllm").fits
    full = load_config("configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml", [], 1)
    assert not plan.make_plan(full, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="vllm").fits


def test_lora_plan_counts_the_adapters_and_no_reference():
    # Qwen2.5-Math-1.5B: hidden 1536, 12 heads x 128, 2 KV heads (256), MLP 8960, 28 layers. Rank 16 on
    # all seven linear layers: 16 x [(1536+1536) q + 2 x (1536+256) k, v + (1536+1536) o
    # + 2 x (1536+8960) gate, up + (8960+1536) down] = 16 x 41,216 = 659,456 per layer; x 28 = 18,464,768
    config = "configs/qwen2.5-math-1.5b/pspo_lora.yaml"
    cfg = load_config(config, [], 1)
    a, _ = plan.load_arch(cfg.model.name_or_path, config)
    assert plan.lora_params(a, LoraConfig(rank=16)) == 18_464_768
    assert plan.lora_params(a, LoraConfig(rank=8, target_modules="q_proj, v_proj")) == 28 * 8 * (3072 + 1792)
    p = plan.make_plan(cfg, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="vllm")
    rows = {key: b for key, _, b, _ in p.rows}
    assert rows["params"] == 2 * a.params                                 # the bf16 base, whole
    assert rows["adapters"] == 16 * 18_464_768                             # fp32 weight, grad, m, v
    assert "ref" not in rows and "grads" not in rows and "adam" not in rows
    # at the full fine-tuning recipe's budget (36864): 2 x 1.54B bytes of base against 16 x 1.54B of
    # weights, gradients and AdamW state, and no 4 x 1.54B reference: over 20 GiB less
    same = load_config(config, ["--train.micro_batch_tokens=36864"], 1)
    full = plan.make_plan(load_config("configs/qwen2.5-math-1.5b/pspo.yaml", [], 1), a, gpus=1,
                          gpu_bytes=int(79.2 * GiB), engine="vllm")
    assert plan.make_plan(same, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="vllm").peak < full.peak - 20 * GiB


def test_a_packed_micro_batch_is_planned_as_the_rows_that_hold_its_budget():
    # 1.5B recipe: sequences of 512 + 3584 = 4096 tokens. A budget of 5000: unpacked, a micro-batch holds
    # floor(5000 / 4096) = 1 full-length row; packed, it holds up to 5000 tokens of any lengths, planned as
    # ceil(5000 / 4096) = 2 full rows (a budget that is a multiple of 4096 plans the same either way)
    config = "configs/qwen2.5-math-1.5b/grpo.yaml"
    acts = {}
    for packing in ("true", "false"):
        cfg = load_config(config, ["--train.micro_batch_tokens=5000", f"--train.packing={packing}"], 1)
        a, _ = plan.load_arch(cfg.model.name_or_path, config)
        rows = plan.make_plan(cfg, a, gpus=1, gpu_bytes=int(79.2 * GiB), engine="vllm").rows
        acts[packing] = next(text for key, text, _, _ in rows if key == "acts")
    assert acts["true"].startswith("activations, 2 x 4096 tokens")
    assert acts["false"].startswith("activations, 1 x 4096 tokens")
