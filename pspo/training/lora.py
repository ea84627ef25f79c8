"""LoRA: low-rank adapters on the policy through peft (docs/methods.md §8, "LoRA").

With model.lora.rank = r > 0, every targeted linear layer W (model.lora.target_modules; "all-linear":
every linear layer of the decoder, not the output head) computes W x + (alpha / r) B A x, with A
(r x in) and B (out x r) trainable and W frozen. peft injects the adapters into the transformers
model in place, so `Policy` runs unchanged; only the adapters train and enter the optimizer. Under
model.bf16 the frozen base is held in bf16 (no float32 master copy, no gradient, no AdamW state)
and the adapters in float32.

The KL reference comes for free: it is the policy with its adapters switched off (`BaseReference`),
the base weights, so no second model is loaded. Checkpoints hold the adapter in peft's own format
(adapter_config.json + adapter_model.safetensors, loadable by `PeftModel.from_pretrained` on the
base); `merged_folder` (and `python -m pspo.training.lora merge CHECKPOINT OUT`) writes the merged
full-weight model that transformers and vLLM load as a plain one.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import torch
from safetensors.torch import load_file

from pspo.training.config import LoraConfig, first_line

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraError(ValueError):
    """Adapters that cannot be added or loaded; the message is one line naming the key or file."""


def is_adapter(path: str) -> bool:
    """A folder holding a peft adapter (a LoRA checkpoint) rather than full weights."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def add_adapters(lm: torch.nn.Module, lora: LoraConfig):
    """Inject LoRA adapters into `lm` in place (peft); returns the PeftModel wrapping it. Only the
    adapters require grad; they are float32 whatever the base's dtype."""
    from peft import get_peft_model
    try:
        peft_model = get_peft_model(lm, peft_config(lora), autocast_adapter_dtype=True)
    except ValueError as e:                      # no module matches target_modules
        raise LoraError(f"model.lora.target_modules: {first_line(e, 200)}") from None
    for name, p in lm.named_parameters():        # float32 adapters also on a bf16 base
        if "lora_" in name and p.dtype != torch.float32:
            p.data = p.data.float()
    return peft_model


def peft_config(lora: LoraConfig):
    """model.lora as peft's LoraConfig (what add_adapters injects, what adapter_config.json holds)."""
    from peft import LoraConfig as PeftLoraConfig
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.targets, bias="none", task_type="CAUSAL_LM")


def check_adapter_config(path: str, lora: LoraConfig) -> None:
    """LoraError (one line) unless the adapter of checkpoint `path` (its adapter_config.json) has model.lora's
    rank, alpha and target modules; read before a model is built or loaded (checkpoint.resolve_resume)."""
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{path}/{ADAPTER_CONFIG}: cannot read it ({first_line(e, 200)})") from None
    targets = saved.get("target_modules")
    targets = "all-linear" if targets == "all-linear" else ",".join(sorted(targets or []))
    want = "all-linear" if lora.targets == "all-linear" else ",".join(sorted(lora.targets))
    for key, theirs, ours in (("rank", saved.get("r"), lora.rank), ("alpha", saved.get("lora_alpha"), lora.alpha),
                              ("target_modules", targets, want)):
        if theirs != ours and not (key == "target_modules" and want == "all-linear"):
            raise LoraError(f"model.lora.{key}: the checkpoint {path} was trained with {theirs}, this run has "
                            f"{ours}; resume with the same setting")


def load_adapter_weights(peft_model, path: str, lora: LoraConfig | None = None) -> None:
    """A checkpoint's adapter (peft's file) into the injected adapters, before sharding; with `lora`, its
    adapter_config.json must match model.lora's rank, alpha and target modules (`check_adapter_config`)."""
    from peft import set_peft_model_state_dict
    if lora is not None:
        check_adapter_config(path, lora)
    file = os.path.join(path, ADAPTER_WEIGHTS)
    try:
        state = load_file(file)
    except Exception as e:  # noqa: BLE001 - missing or corrupt file: one line
        raise LoraError(f"{file}: cannot read the adapter ({first_line(e, 200)})") from None
    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise LoraError(f"{file}: the adapter does not match model.lora (missing {missing[:2]}, unexpected "
                        f"{list(result.unexpected_keys)[:2]}); resume with the LoRA settings it was trained with")


def save_adapter(peft_model, state: dict[str, torch.Tensor], folder: str) -> None:
    """peft's adapter files from the unsharded state (distributed.full_model_state's keys: those of the
    transformers model); rank 0 only."""
    prefixed = {f"base_model.model.{k}": v for k, v in state.items() if "lora_" in k}
    # save_embedding_layers=False: the embeddings are never adapted (config.py refuses them as targets) nor
    # resized. peft's default "auto" looks for the base's config.json, and for a hub id asks the hub
    # (huggingface_hub.file_exists) at every save: on every rank at every adapter sync, a network timeout
    # each time on an offline cluster.
    peft_model.save_pretrained(folder, state_dict=prefixed, save_embedding_layers=False)


def peft_key(name: str) -> str:
    """The key peft's adapter file holds a parameter under: prefixed, the adapter's name dropped
    ("model.layers.0.self_attn.q_proj.lora_A.default.weight" -> "base_model.model.model.layers.0.self_attn.q_proj
    .lora_A.weight")."""
    return "base_model.model." + name.replace(".default.", ".")


def write_adapter(folder: str, lora: LoraConfig, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """peft's adapter files without a peft model (an engine process holds none): model.lora's
    adapter_config.json, and `tensors` ((name, tensor) as adapter_params yields them, e.g.
    "model.layers.0.self_attn.q_proj.lora_A.default.weight") under the keys peft's save writes, which drop
    the adapter's name ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")."""
    from safetensors.torch import save_file
    peft_config(lora).save_pretrained(folder)
    save_file({peft_key(name): t.detach().cpu().contiguous()
               for name, t in tensors}, os.path.join(folder, ADAPTER_WEIGHTS))


@torch.no_grad()
def merged_params(lm: torch.nn.Module):
    """(name, tensor) of the model with its adapters merged, under the plain transformers names: each
    targeted weight W + (alpha / r) B A, every other parameter as it is (one process, unsharded).
    What a full-weight sync would stream instead of the adapter (bench/lora_sync.py)."""
    for name, param in lm.named_parameters():
        if "lora_" in name:
            continue
        if ".base_layer." in name:
            module = lm.get_submodule(name.rsplit(".base_layer.", 1)[0])
            if name.endswith(".weight"):
                param = param + module.get_delta_weight("default").to(param.dtype)
            name = name.replace(".base_layer.", ".")
        yield name, param.detach()


class BaseReference:
    """The KL reference of a LoRA policy: the policy itself with its adapters switched off, i.e. the
    frozen base model. Called like a Policy (score_logprobs calls it), under no_grad there."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.peft.disable_adapter():
            return self.policy(*args, **kwargs)


def trainable_share(policy: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(policy.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merged_folder(checkpoint: str, out: str) -> str:
    """Merge a LoRA checkpoint's adapter into its base (adapter_config.json's base_model_name_or_path)
    and save a plain full-weight transformers folder (weights, config, tokenizer) at `out`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with open(os.path.join(checkpoint, ADAPTER_CONFIG)) as f:
        base = json.load(f).get("base_model_name_or_path") or ""
    try:                                          # a local folder, or a hub id (its cache, or a download)
        lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - missing, not cached offline, rejected: one line
        raise LoraError(f"{checkpoint}/{ADAPTER_CONFIG}: cannot load its base model {base!r} "
                        f"({first_line(e, 200)})") from None
    merged = PeftModel.from_pretrained(lm, checkpoint).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint if os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json"))
                                  else base).save_pretrained(out)
    return out


def merged_for_eval(checkpoint: str, barrier) -> str:
    """eval.py on a LoRA checkpoint: the merged model in a temporary folder named after the checkpoint and
    this launch (each node's local rank 0 writes it, every rank reads it after `barrier()`); the caller's
    local rank 0 removes it when done."""
    import hashlib
    import shutil
    import tempfile
    # the ranks of one launch on one node share the folder (their parent is torchrun's agent), two
    # evaluations never do; each node writes its own copy (its /tmp is its own)
    torchrun = "LOCAL_RANK" in os.environ
    launch = os.getppid() if torchrun else os.getpid()
    key = hashlib.sha1(f"{os.path.abspath(checkpoint)}:{launch}".encode()).hexdigest()[:12]
    out = os.path.join(tempfile.gettempdir(), f"pspo-merged-{key}")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(out, ignore_errors=True)
        merged_folder(checkpoint, out)
    barrier()
    return out


def main(argv: list[str]) -> int:
    """python -m pspo.training.lora merge CHECKPOINT OUT: the merged full-weight model."""
    if len(argv) != 3 or argv[0] != "merge":
        print("usage: python -m pspo.training.lora merge CHECKPOINT OUT", file=sys.stderr)
        return 2
    _, checkpoint, out = argv
    if not is_adapter(checkpoint):
        print(f"{checkpoint}: no {ADAPTER_CONFIG}: not a LoRA checkpoint", file=sys.stderr)
        return 2
    if os.path.exists(out):
        print(f"{out} exists; remove it or name another folder", file=sys.stderr)
        return 2
    try:
        print(f"merged model: {merged_folder(checkpoint, out)}")
    except LoraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
