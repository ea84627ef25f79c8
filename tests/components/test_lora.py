"""LoRA through peft (pspo/training/lora.py): only the adapters train, the reference is the base with
them switched off, the saved adapter is peft's own and loads back (in peft and merged) to the trainer's
log-probs and is saved without asking the hub, a bf16 base with float32 adapters, ρ = 1 at the first
iteration (no dropout), and the settings validated in one line."""
import dataclasses
import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from pspo.engines.decode import decode_twin
from pspo.training import distributed
from pspo.training.config import ConfigError, load_config
from pspo.training.logprobs import forward_logprobs, score_logprobs
from pspo.training.lora import BaseReference, is_adapter, load_adapter_weights, merged_folder, save_adapter
from pspo.training.micro_batches import plan_micro_batches
from pspo.training.model import Policy, build_policy
from pspo.training.optim import build_optimizer
from test_packing import P, T, rows


def lora_policy(path, rank=4, bf16=False, checkpointing=False, targets="all-linear", seed=0, dropout=0.0):
    """A LoRA policy whose B matrices are random (peft starts them at 0, where the adapters change nothing);
    `dropout` set past the config's validation (which refuses it)."""
    cfg = load_config(None, [f"--model.lora.rank={rank}", f"--model.lora.target_modules={targets}"])
    lora = dataclasses.replace(cfg.model.lora, dropout=dropout)
    policy = build_policy(path, chunk_tokens=64, bf16=bf16, gradient_checkpointing=checkpointing, lora=lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


def logprobs(model, ids, attention, mask):
    return score_logprobs(model, ids, attention, T=T, temperature=1.0, plan=plan_micro_batches(attention, mask, 64, 0))


def test_only_the_adapters_train(tiny_model_path):
    # the tiny model: hidden 128, 4 heads x 32 (q 128), 2 KV heads (64), MLP 384, 4 layers. Rank 4 on all
    # seven linear layers: 4 x [(128+128) q + 2 x (128+64) k, v + (128+128) o + 2 x (128+384) gate, up
    # + (384+128) down] = 4 x 2,432 = 9,728 per layer; x 4 layers = 38,912
    policy = lora_policy(tiny_model_path)
    want = 38_912
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == want
    optimizer, _ = build_optimizer(policy, load_config(None, []))
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == want
    assert "lm_head" not in " ".join(trainable)                      # all-linear: not the output head


def test_the_reference_is_the_base_with_the_adapters_off(tiny_model_path):
    policy = lora_policy(tiny_model_path)
    base = build_policy(tiny_model_path, chunk_tokens=64, trainable=False)
    ids, attention, mask = rows(policy.lm.config.vocab_size)
    ref = logprobs(BaseReference(policy), ids, attention, mask)
    torch.testing.assert_close(ref, logprobs(base, ids, attention, mask), atol=1e-6, rtol=0)
    adapted = logprobs(policy, ids, attention, mask)
    assert float(((adapted - ref).abs() * mask).max()) > 1e-3             # the adapters do change π
    # and switching them off does not leave them off
    torch.testing.assert_close(logprobs(policy, ids, attention, mask), adapted)


def test_the_saved_adapter_loads_in_peft_and_merged(tiny_model_path, tmp_path):
    from peft import PeftModel
    policy = lora_policy(tiny_model_path, seed=1)
    ids, attention, mask = rows(policy.lm.config.vocab_size, seed=4)
    trainer = logprobs(policy, ids, attention, mask)
    folder = str(tmp_path / "checkpoint-1")
    save_adapter(policy.peft, distributed.full_model_state(policy, trainable_only=True), folder)
    assert is_adapter(folder) and {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(folder))
    with open(os.path.join(folder, "adapter_config.json")) as f:
        saved = json.load(f)
    assert saved["r"] == 4 and saved["lora_alpha"] == 32 and saved["base_model_name_or_path"] == tiny_model_path
    # peft's own loader on a fresh base: the trainer's log-probs
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), folder)
    torch.testing.assert_close(logprobs(Policy(loaded.base_model.model, 64).eval(), ids, attention, mask), trainer,
                               atol=1e-6, rtol=0)
    # our resume path: a fresh LoRA policy with the saved adapter
    again = lora_policy(tiny_model_path, seed=99)
    load_adapter_weights(again.peft, folder)
    torch.testing.assert_close(logprobs(again, ids, attention, mask), trainer, atol=1e-6, rtol=0)
    # merged into a plain transformers folder (what eval.py and vLLM load)
    merged = merged_folder(folder, str(tmp_path / "merged"))
    assert not is_adapter(merged) and os.path.isfile(os.path.join(merged, "model.safetensors"))
    plain = build_policy(merged, chunk_tokens=64, trainable=False)
    # W + (α/r)·B·A rounds once in float32 where the adapter path adds two products: log-probs near -9
    # differ by ~1e-5 depending on the kernels' thread split, an unmerged adapter by far more
    torch.testing.assert_close(logprobs(plain, ids, attention, mask), trainer, atol=5e-5, rtol=0)


def test_an_adapter_written_without_peft_model_is_the_saved_one(tiny_model_path, tmp_path):
    # an engine process (no peft model) writes each version from the staged tensors (adapter_params' names):
    # the same keys and tensors as peft's save, a config with model.lora's rank, alpha and targets, and peft's
    # loader reads it back into a fresh policy
    from safetensors.torch import load_file
    from pspo.engines.vllm_engine import adapter_params
    from pspo.training.lora import check_adapter_config, write_adapter
    policy = lora_policy(tiny_model_path, seed=2)
    saved, written = str(tmp_path / "saved"), str(tmp_path / "written")
    save_adapter(policy.peft, distributed.full_model_state(policy, trainable_only=True), saved)
    cfg = load_config(None, ["--model.lora.rank=4"])
    write_adapter(written, cfg.model.lora, adapter_params(policy.lm))
    a, b = (load_file(os.path.join(f, "adapter_model.safetensors")) for f in (saved, written))
    assert sorted(a) == sorted(b) and len(a) == 2 * 7 * 4                   # A and B of 7 layers x 4 blocks
    assert all(torch.equal(a[k], b[k]) for k in a)
    check_adapter_config(written, cfg.model.lora)                              # rank, alpha, targets
    again = lora_policy(tiny_model_path, seed=99)
    load_adapter_weights(again.peft, written)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(adapter_params(again.lm), adapter_params(policy.lm)))


def test_a_mismatched_adapter_is_refused_in_one_line(tiny_model_path, tmp_path):
    from pspo.training.lora import LoraError
    policy = lora_policy(tiny_model_path, rank=4)
    save_adapter(policy.peft, distributed.full_model_state(policy, trainable_only=True), str(tmp_path / "a"))
    other = lora_policy(tiny_model_path, rank=4, targets="q_proj,v_proj")
    with pytest.raises(LoraError, match="does not match model.lora") as e:
        load_adapter_weights(other.peft, str(tmp_path / "a"))
    assert "\n" not in str(e.value)


def test_saving_an_adapter_asks_no_hub(tiny_model_path, tmp_path, monkeypatch):
    # A policy loaded by hub id (its adapter_config's base_model_name_or_path is "Qwen/Qwen2.5-1.5B-Instruct", not
    # a folder): peft's default save_embedding_layers="auto" asks the hub whether that repo has a config.json at
    # every save (one HTTPS request per rank per adapter sync; offline, a timeout). HF_HUB_OFFLINE is unset here,
    # so nothing but the code keeps the request from being made: every attempt to resolve or connect is recorded.
    import socket

    import huggingface_hub.constants
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    policy = lora_policy(tiny_model_path)
    policy.peft.peft_config["default"].base_model_name_or_path = "Qwen/Qwen2.5-1.5B-Instruct"
    folder = str(tmp_path / "adapter")
    save_adapter(policy.peft, distributed.full_model_state(policy, trainable_only=True), folder)
    assert attempts == []
    with open(os.path.join(folder, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    # only the adapters were written: no embedding or head rows
    from safetensors.torch import load_file
    names = list(load_file(os.path.join(folder, "adapter_model.safetensors")))
    assert names and all("lora_A" in n or "lora_B" in n for n in names)


def test_bf16_base_float32_adapters_with_checkpointing(tiny_model_path):
    policy = lora_policy(tiny_model_path, bf16=True, checkpointing=True).train()
    dtypes = {("lora" if "lora_" in n else "base"): p.dtype for n, p in policy.named_parameters()
              if "embed" not in n and "norm" not in n}
    assert dtypes == {"base": torch.bfloat16, "lora": torch.float32}
    ids, attention, mask = rows(policy.lm.config.vocab_size)
    for b in plan_micro_batches(attention, mask, 64, 30, True):           # packed, checkpointed, bf16
        logp, _ = policy(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed=b.packed)
        (logp * mask[b.rows, :b.width]).sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n and g.dtype == torch.float32 for n, g in grads.items())
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    # the static decoder shares the bf16 base instead of copying it
    twin, pairs = decode_twin(policy.lm, bf16=True)
    assert pairs and all(p.dtype == torch.float32 for _, p in pairs)      # only the float32 adapters copied
    down, twin_down = policy.lm.model.layers[0].mlp.down_proj, twin.model.layers[0].mlp.down_proj
    assert twin_down.base_layer.weight is down.base_layer.weight


def test_unknown_target_modules_are_one_line(tiny_model_path):
    from pspo.training.lora import LoraError
    with pytest.raises(LoraError, match="model.lora.target_modules: ") as e:
        lora_policy(tiny_model_path, targets="foo_proj")
    assert "\n" not in str(e.value)


def test_lora_settings_are_validated_in_one_line():
    cfg = load_config("configs/pspo_lora.yaml")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (16, 32.0, "all-linear")
    for override, message in [("--model.lora.rank=-1", "model.lora.rank: expected >= 0"),
                              ("--model.lora.alpha=0", "model.lora.alpha: expected a finite number > 0"),
                              ("--model.lora.dropout=0.05", "model.lora.dropout: expected 0 (π_old is scored "
                               "without dropout"),
                              ("--model.lora.target_modules=q proj", "model.lora.target_modules: expected"),
                              ("--model.lora.rnak=4", "model.lora.rnak: unknown key, expected one of rank"),
                              ("--model.lora=4", "model.lora: expected a mapping"),
                              ("--model.lora.target_modules=q_proj,lm_head", "model.lora.target_modules: expected "
                               "decoder layers only")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [override])


def test_the_first_iteration_ratio_is_one_with_lora(tiny_model_path):
    # π_old is scored in eval mode (score_logprobs), the update's log-probs in train mode (forward_logprobs after
    # policy.train(), as update.py runs them). With the same network in both, ρ = exp(log π − log π_old) = exp(0)
    # = 1 on every token before the first optimizer step. LoRA dropout 0.5 (which model.lora.dropout refuses)
    # zeroes half of the adapters' inputs in train mode only: then ρ != 1, the clip sees a ratio the step did
    # not make.
    def first_ratio(policy):
        ids, attention, mask = rows(policy.lm.config.vocab_size, seed=2)
        plan = plan_micro_batches(attention, mask, 64, 0)
        old = score_logprobs(policy, ids, attention, T=T, temperature=1.0, plan=plan)      # (N, T), eval
        policy.train()
        torch.manual_seed(0)
        with torch.no_grad():
            logp = torch.zeros_like(old)
            for b in plan:
                logp[b.rows, :b.width] = forward_logprobs(policy, b, input_ids=ids, attention_mask=attention, T=T,
                                                          temperature=1.0)[0]
        policy.eval()
        return torch.exp(logp - old)[mask.bool()]                                          # ρ per real token

    rho = first_ratio(lora_policy(tiny_model_path, seed=3))
    torch.testing.assert_close(rho, torch.ones_like(rho), atol=1e-6, rtol=0)
    with_dropout = first_ratio(lora_policy(tiny_model_path, seed=3, dropout=0.5))
    assert float((with_dropout - 1).abs().max()) > 1e-2


def test_merged_weights_are_w_plus_scaled_b_a_hand_worked(tiny_model_path):
    # rank 4, alpha 32: scale alpha / r = 8. Layer 0's q_proj with A = 0 but A[0, 0] = 1 and B = 0 but
    # B[0, 0] = 2: B A is 0 but (B A)[0, 0] = 2 x 1 = 2, so the merged weight is W + 8 x 2 = W + 16 at [0, 0]
    # and W everywhere else; under the plain transformers name (no base_layer); no adapter tensors
    from pspo.training.lora import merged_params
    policy = lora_policy(tiny_model_path)
    q = policy.lm.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.zero_()
        q.lora_A["default"].weight[0, 0] = 1.0
        q.lora_B["default"].weight[0, 0] = 2.0
    merged = dict(merged_params(policy.lm))
    base = q.base_layer.weight.detach()
    want = base.clone()
    want[0, 0] += 16.0
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], want)
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    assert torch.equal(merged["model.layers.1.self_attn.q_proj.weight"],
                       policy.lm.model.layers[1].self_attn.q_proj.base_layer.weight.detach())
