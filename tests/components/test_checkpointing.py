"""model.gradient_checkpointing: none, selective and full (model.py: enable_checkpointing) and auto, the memory
plan's choice (plan.py), from the config to the policy, train.py's start-up and the update bench
(docs/gpu.md#plan). A mode changes what is kept and recomputed, never a gradient."""
import importlib.util
import json
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from pspo.training import plan
from pspo.training.config import ConfigError, load_config
from pspo.training.logprobs import forward_logprobs
from pspo.training.micro_batches import plan_micro_batches
from pspo.training.model import build_policy, enable_checkpointing, save_matmuls

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("none", "selective", "full")


def bench():
    spec = importlib.util.spec_from_file_location("micro_bench", os.path.join(ROOT, "bench", "micro_batches.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_setting_takes_the_modes_and_the_old_booleans(tmp_path):
    assert load_config(None).model.gradient_checkpointing == "auto"                 # the default
    for mode in ("none", "selective", "full", "auto"):
        assert load_config(None, [f"--model.gradient_checkpointing={mode}"]).model.gradient_checkpointing == mode
    # YAML's true / false (older configs) and the same on the command line: full / none
    for written, mode in (("true", "full"), ("false", "none"), ("True", "full")):
        path = tmp_path / f"{written}.yaml"
        path.write_text(f"model:\n  gradient_checkpointing: {written}\n")
        assert load_config(str(path)).model.gradient_checkpointing == mode
        assert load_config(None, [f"--model.gradient_checkpointing={written}"]).model.gradient_checkpointing == mode
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.gradient_checkpointing=partial"])
    assert str(e.value) == ("model.gradient_checkpointing: expected none | selective | full | auto (or true / "
                            "false: full / none), got 'partial'")


def batch(path):
    """Three rows of 20 tokens (one left-padded by 5), 8 completion tokens each, and their micro-batch:
    unpacked, or packed into one row."""
    ids = torch.randint(3, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, :5] = 0
    mask = torch.ones(3, 8)
    return ids, attention, {packing: plan_micro_batches(attention, mask, 4, 100 if packing else 0, packing)[0]
                            for packing in (False, True)}


@pytest.mark.parametrize("bf16", [False, True])
def test_every_mode_gives_the_same_gradients(tiny_model_path, bf16):
    # a recompute runs the same kernels on the same inputs: the gradients are equal, not close
    ids, attention, micro = batch(tiny_model_path)
    for packing in (False, True):
        grads = {}
        for mode in MODES:
            policy = build_policy(tiny_model_path, chunk_tokens=64, bf16=bf16, gradient_checkpointing=mode).train()
            logp, _ = forward_logprobs(policy, micro[packing], input_ids=ids, attention_mask=attention, T=8,
                                       temperature=0.7)
            (logp * torch.arange(8.0)).sum().backward()
            grads[mode] = torch.cat([p.grad.flatten() for p in policy.parameters()])
        assert torch.equal(grads["selective"], grads["none"]) and torch.equal(grads["full"], grads["none"])


class Ops(TorchDispatchMode):
    """How many times each op runs inside the mode."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packing", [False, True])
def test_selective_recomputes_the_elementwise_ops_and_no_matmul(tiny_model_path, packing):
    # The ops the backward runs, for the tiny model's 4 layers. none runs no forward op again. selective
    # reruns each layer's elementwise ops (2 RMSNorms: 2 rsqrt; SiLU) and none of its matmuls: its forward's q, k,
    # v projections (addmm: they have biases) do not run, the mm count (the gradients' products) is none's,
    # the attention kernel's forward does not run. full reruns the whole layer: 4 x 3 addmm, 4 attentions.
    ids, attention, micro = batch(tiny_model_path)
    ops = {}
    for mode in MODES:
        policy = build_policy(tiny_model_path, chunk_tokens=64, gradient_checkpointing=mode).train()
        logp, _ = forward_logprobs(policy, micro[packing], input_ids=ids, attention_mask=attention, T=8,
                                   temperature=1.0)
        with Ops() as counted:
            logp.sum().backward()
        ops[mode] = counted.counts
    attention_forward = "aten::_scaled_dot_product_flash_attention_for_cpu"
    backward_attention = ops["none"][attention_forward + "_backward"]
    assert backward_attention == (4 if not packing else 4 * 3)          # packed: one call per sequence
    assert ops["none"]["aten::rsqrt"] == ops["none"]["aten::silu"] == ops["none"]["aten::addmm"] == 0
    assert ops["selective"]["aten::rsqrt"] == 8 and ops["selective"]["aten::silu"] == 4
    assert ops["selective"]["aten::addmm"] == ops["selective"][attention_forward] == 0
    assert ops["selective"]["aten::mm"] == ops["none"]["aten::mm"]
    assert ops["full"]["aten::addmm"] == 12 and ops["full"][attention_forward] == backward_attention
    assert ops["full"]["aten::mm"] > ops["none"]["aten::mm"]


def test_the_selective_rule_keeps_projections_and_attention():
    # a projection's output (inner dimension 1536, or the tiny model's 128) is kept; a LoRA adapter's B
    # (inner dimension: its rank, 16) and the elementwise ops are recomputed
    def rule(op, *args):
        return save_matmuls(None, op, *args)
    x = torch.empty(4, 1536)
    assert rule(torch.ops.aten.mm.default, x, torch.empty(1536, 8)) == CheckpointPolicy.MUST_SAVE
    assert rule(torch.ops.aten.addmm.default, torch.empty(8), torch.empty(4, 128), torch.empty(128, 8)) \
        == CheckpointPolicy.MUST_SAVE
    lora_b = rule(torch.ops.aten.mm.default, torch.empty(4, 16), torch.empty(16, 1536))
    assert lora_b == CheckpointPolicy.PREFER_RECOMPUTE
    assert rule(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == CheckpointPolicy.MUST_SAVE
    for op in (torch.ops.aten.silu.default, torch.ops.aten.rsqrt.default, torch.ops.aten._to_copy.default):
        assert rule(op, x) == CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(ValueError):                     # auto is resolved by the plan, never built
        enable_checkpointing(torch.nn.Linear(2, 2), "auto")


def test_generation_under_selective_checkpointing_is_unchanged(tiny_model_path):
    # selective checkpointing recomputes only in train mode: back in eval mode after a training forward,
    # generate keeps its KV cache and draws the tokens of the same weights without checkpointing
    from pspo.engines.hf_engine import HFEngine
    from pspo.engines.sampling import sequence_seeds
    from pspo.training.model import load_tokenizer
    tokenizer = load_tokenizer(tiny_model_path)
    ids, attention, micro = batch(tiny_model_path)
    out = {}
    for mode in ("none", "selective"):
        policy = build_policy(tiny_model_path, chunk_tokens=64, gradient_checkpointing=mode).train()
        forward_logprobs(policy, micro[False], input_ids=ids, attention_mask=attention, T=8,
                         temperature=1.0)[0].sum().backward()
        policy.eval()
        prompts = [tokenizer("12+34=")["input_ids"], tokenizer("5+6=")["input_ids"]]
        out[mode] = HFEngine(policy, tokenizer, 64).generate(prompts, 2, 1.0, 1.0, 8,
                                                             sequence_seeds(1, 1, torch.arange(2), 2))
    assert torch.equal(out["none"].completion_ids, out["selective"].completion_ids)


def test_the_bench_resolves_auto_with_the_plan_of_its_batch():
    # bench/micro_batches.py --checkpointing auto: the first mode whose update_peak for the batch, with the
    # allocator's cache and the constant (plan.device_bytes), fits the GPU; none on CPU (no GPU memory)
    micro_bench = bench()
    a = plan.Arch(64, 128, 2, 4, 2, 16, 100, 80704, 37120)
    runs = [[(4000, 1000), (2000, 500)], [(3000, 100)]]                    # (positions, scored) per micro-batch
    need = {mode: plan.device_bytes(max(plan.update_peak(a, sizes, bf16=False, checkpointing=mode, chunk_tokens=2048)
                                        for sizes in runs)) for mode in MODES}
    assert need["none"] > need["selective"] > need["full"]

    def resolve(asked, gpu_bytes):
        return micro_bench.resolve_checkpointing(asked, a, runs, bf16=False, gpu_bytes=gpu_bytes)
    assert resolve("auto", 0) == "none" and resolve("selective", need["full"]) == "selective"
    assert [resolve("auto", need[m]) for m in MODES] == list(MODES)
    assert resolve("auto", need["none"] - 1) == "selective" and resolve("auto", need["full"] - 1) == "full"


@pytest.mark.slow
def test_the_bench_runs_the_mode_asked_and_writes_the_plan(tmp_path):
    # the 8 x 512 random Qwen2, 4 sequences, packed: the JSON names the mode that ran (the flag alone: full;
    # auto on CPU: none) and the plan of the micro-batches it ran, with the allocator's cache
    micro_bench = bench()
    for i, (flag, asked, ran) in enumerate(((["--checkpointing", "selective"], "selective", "selective"),
                                             (["--checkpointing"], "full", "full"),
                                             (["--checkpointing", "auto"], "auto", "none"), ([], "none", "none"))):
        out = tmp_path / f"{i}.json"
        micro_bench.main(["--sequences", "4", "--max-completion", "24", "--max-prompt", "24", "--reps", "1",
                          "--modes", "packed", *flag, "--json", str(out)])
        figures = json.loads(out.read_text())
        assert (figures["checkpointing"], figures["checkpointing_asked"]) == (ran, asked)
        packed = figures["modes"]["packed"]
        assert packed["plan_peak_gib"] > plan.UPDATE_MARGIN / 2**30
        assert packed["plan_reserved_gib"] == pytest.approx(packed["plan_peak_gib"] * (1 + plan.ALLOCATOR_SLACK),
                                                            abs=1e-6)
        assert packed["peak_allocated_gib"] is None and figures["outside_allocator_gib"] is None     # CPU


@pytest.mark.slow
def test_train_py_builds_the_policy_with_the_mode_its_plan_line_names(tmp_path, tiny_model_path, run_main,
                                                                     monkeypatch):
    # the start-up line names the mode; auto on CPU is none; the policy is built with that mode
    from pspo.training import model
    built = []
    original = model.enable_checkpointing
    monkeypatch.setattr(model, "enable_checkpointing", lambda lm, mode: built.append(mode) or original(lm, mode))
    base = ["--config", "configs/grpo.yaml", f"--model.name_or_path={tiny_model_path}", "--train.prompts_per_step=4",
            "--rollout.num_generations=2", "--train.max_steps=1", "--train.progress=false", "--rollout.engine=hf",
            "--data.eval=", "--rollout.max_new_tokens=4"]
    ran = run_main("train", *base, f"--train.output_dir={tmp_path / 'auto'}")
    line = next(line for line in ran.out.splitlines() if line.startswith("memory plan per GPU"))
    assert "checkpointing none)" in line and "auto -> none on CPU" in line and built == ["none"]
    ran = run_main("train", *base, f"--train.output_dir={tmp_path / 'selective'}",
                   "--model.gradient_checkpointing=selective")
    line = next(line for line in ran.out.splitlines() if line.startswith("memory plan per GPU"))
    assert "checkpointing selective)" in line and "auto" not in line and built == ["none", "selective"]
