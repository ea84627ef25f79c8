"""The policy and the frozen reference: loading, and per-token log-probs of completions.

`Policy` wraps a transformers causal LM. Its forward returns log π(o_t | q, o_<t) for the
completion tokens, from logits divided by the sampling temperature, in float32, one
(tokens x vocab) block at a time (token_logprobs.py; docs/methods.md §1, "Log-probabilities at the
sampling temperature"). Generation also goes through
`Policy.__call__` (generate=True): under FSDP2 the wrapper is the root module, and only work done
inside the root's forward sees its gathered parameters (embeddings, final norm, lm_head).

What makes scoring fast (docs/gpu.md, "The update's speed"), each chosen once at start-up: the attention
kernels (packed_attention.py, train.attention), each decoder layer compiled (`compile_layers`,
train.compile) and the log-prob head (token_logprobs.py, model.logprob_head).
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from pspo.training.compiled import Compiled
from pspo.training.config import Config, LoraConfig, first_line
from pspo.training.lora import add_adapters
from pspo.training.packed_attention import PACKED_ATTENTION, UNPINNED, Kernels, Packed, pin_kernels, scoring_mask
from pspo.training.token_logprobs import token_logprobs


hf_logging.disable_progress_bar()          # per-file "Loading weights" bars would drown the training bar


class ModelError(ValueError):
    """The model path cannot be loaded; the message is one line."""


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Left-padding tokenizer (generation pads prompts on the left); pad falls back to eos."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left",
                                                  trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing, malformed or rejected by transformers' validation
        raise ModelError(f"model.name_or_path: cannot load a tokenizer from {path!r} "
                         f"({first_line(e)})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(path: str, trust_remote_code: bool = False):
    """The model's transformers config (config.json) alone: cheap, no weights."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing, malformed or rejected by transformers' validation
        raise ModelError(f"model.name_or_path: cannot load a model config from {path!r} "
                         f"({first_line(e)})") from None


def load_causal_lm(path: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """float32 master weights; bf16 is applied by autocast at compute time (model.bf16). A frozen LoRA
    base is loaded in bf16 (dtype) instead: it needs no master copy."""
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing, corrupt (SafetensorError), foreign or rejected
        raise ModelError(f"model.name_or_path: cannot load a causal LM from {path!r} "
                         f"({first_line(e)})") from None




class Policy(torch.nn.Module):
    """A causal LM that scores completions (forward) and generates (forward(generate=True))."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int = 2048, bf16: bool = False, head: str = "eager"):
        super().__init__()
        self.lm, self.chunk_tokens, self.bf16, self.head = lm, chunk_tokens, bf16, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int = 0,
                temperature: float = 1.0, generate: bool = False, packed_width: int = 0,
                packed: Packed | None = None, **generate_kwargs):
        """input_ids/attention_mask (N, P+T): left-padded prompt then completion.

        Returns (logp (N, T), entropy (N, T)) for the last T = num_completion_tokens positions.

        Scoring runs padding-free on the left: each row's real tokens are moved to the start
        (right-padded to the longest row) and attention is plain causal, with no padding mask (the
        attention_mask passed to the model is packed_attention.scoring_mask: none is built).
        Causality keeps the pads at a row's end out of every real token's context, so the
        log-probs are those of the left-padded rows, while the attention kernel skips the
        masked triangle (flash attention on a GPU; a padding mask would force the
        memory-efficient kernel over the full square) and no (N, s, s) mask is built.
        packed_width: the longest row's real tokens when the caller knows it (micro_batches.py),
        which spares reading it back from the device.
        packed (a token-budget micro-batch with train.packing): the N sequences go back to back into
        one row with no padding at all, each with its own positions 0..len-1 and attending only to
        itself (packed_attention.py); the head scores only the real completion tokens. The same
        log-probs (within rounding); 0 past each row's completion.
        """
        if generate:
            with self._autocast():
                return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
        if packed is not None:
            return self._packed(input_ids, attention_mask, num_completion_tokens, temperature, packed)
        T = num_completion_tokens
        N, L = input_ids.shape
        lengths = attention_mask.sum(1)                                    # (N,) prompt + completion tokens
        width = packed_width or int(lengths.max())
        width = max(1, width - 1)                    # the last token predicts nothing
        cols = torch.arange(width, device=input_ids.device)
        pads = attention_mask.long().argmax(1)                             # (N,) left padding of each row
        packed_ids = input_ids.gather(1, (pads[:, None] + cols[None]).clamp(max=L - 1))      # (N, width)
        prompts = lengths - attention_mask[:, L - T:].sum(1)               # (N,) prompt tokens
        # hidden at position s predicts token s+1: completion token t of row i is predicted at p_i - 1 + t
        steps = torch.arange(T, device=input_ids.device)
        at = (prompts[:, None] - 1 + steps[None]).clamp(0, width - 1)                       # (N, T)
        with self._autocast():
            hidden = self.lm.base_model(input_ids=packed_ids, position_ids=cols.expand(N, width),
                                        attention_mask=self._no_mask(input_ids.device),
                                        use_cache=False).last_hidden_state                  # (N, width, H)
            hidden = hidden.gather(1, at[:, :, None].expand(-1, -1, hidden.shape[-1]))        # (N, T, H)
            # Under bf16 autocast the head multiplies bf16 operands into float32 logits.
            weight = self.lm.get_output_embeddings().weight                   # (V, H)
            logp, entropy = token_logprobs(hidden, weight, input_ids[:, L - T:], temperature,
                                           self.chunk_tokens, self.head)
        return logp.clone(), entropy   # not a view: FSDP2 hooks backward on the root's outputs

    def _packed(self, input_ids: Tensor, attention_mask: Tensor, T: int, temperature: float,
                packed: Packed) -> tuple[Tensor, Tensor]:
        """forward's packed path: (N, P+T) left-padded rows -> one row of S = packed.tokens tokens."""
        N, L = input_ids.shape
        device = input_ids.device
        lengths = attention_mask.sum(1)                                    # (N,) prompt + completion
        completions = attention_mask[:, L - T:].sum(1)                     # (N,) completion tokens
        ends = lengths.cumsum(0)
        starts = ends - lengths                                            # (N,) each sequence's offset
        S, C = packed.tokens, packed.completion_tokens
        # token j of the row: sequence seq[j], its within[j]-th real token (real tokens start at the pad)
        seq = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=S)      # (S,)
        within = torch.arange(S, device=device) - starts[seq]
        pads = attention_mask.long().argmax(1)                             # (N,) left padding of each row
        row_ids = input_ids[seq, pads[seq] + within][None]                 # (1, S)
        offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)    # (N + 1,)
        # completion token t of sequence i is predicted at starts_i + prompt_i - 1 + t
        seq_c = torch.repeat_interleave(torch.arange(N, device=device), completions, output_size=C)  # (C,)
        t_c = torch.arange(C, device=device) - (completions.cumsum(0) - completions)[seq_c]
        at = starts[seq_c] + (lengths - completions)[seq_c] - 1 + t_c                             # (C,)
        # the scoring mask keeps transformers from building a mask (or reading one back): the attention
        # separates the sequences by their offsets, on the device for varlen, on the host for the
        # per-sequence loop (packed_attention.py)
        with self._autocast():
            hidden = self.lm.base_model(input_ids=row_ids, position_ids=within[None], use_cache=False,
                                        attention_mask=scoring_mask(device), cu_seq_lens_q=offsets,
                                        cu_seq_lens_k=offsets, cu_seq_lens_host=packed.bounds
                                        ).last_hidden_state                          # (1, S, H)
            weight = self.lm.get_output_embeddings().weight                          # (V, H)
            logp_c, entropy_c = token_logprobs(hidden[:, at], weight, input_ids[:, L - T:][seq_c, t_c][None],
                                               temperature, self.chunk_tokens, self.head)   # (1, C)
        zeros = torch.zeros(N, T, device=device, dtype=logp_c.dtype)
        return (zeros.index_put((seq_c, t_c), logp_c[0]),
                zeros.index_put((seq_c, t_c), entropy_c[0].to(zeros.dtype)))

    def _no_mask(self, device: torch.device) -> Tensor | None:
        """What scoring passes as the attention mask: packed_attention.scoring_mask under the policy's
        own attention (build_policy installs it), None under another (transformers then builds the
        causal mask itself)."""
        if self.lm.config._attn_implementation.startswith(PACKED_ATTENTION):
            return scoring_mask(device)
        return None

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.lm.device.type, dtype=torch.bfloat16)


def check_plain_head(lm: torch.nn.Module) -> None:
    """Refuse, in one line, a model whose logits are not hidden @ lm_head.weight^T.

    Policy.forward computes log-probs from the head's weight alone (token_logprobs.py, chunked),
    so a head bias, logit soft-capping (Gemma 2) or a logit scale (Cohere, Granite) would make
    the trainer's π differ from the model's, and from the engine's.
    """
    head = lm.get_output_embeddings()
    name = type(lm).__name__
    if not isinstance(head, torch.nn.Linear):
        raise ModelError(f"model.name_or_path: {name} has no plain linear output head "
                         f"({type(head).__name__}); pspo computes log-probs as hidden @ lm_head.weight")
    if head.bias is not None:
        raise ModelError(f"model.name_or_path: {name}'s lm_head has a bias; "
                         "pspo's log-probs use the weight only")
    config = lm.config
    for key, neutral in (("final_logit_softcapping", None), ("logit_scale", None), ("logits_scaling", 1.0)):
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            raise ModelError(f"model.name_or_path: {name} sets {key}={value} (its logits are "
                             "transformed after lm_head); pspo supports plain lm_head logits only")


def check_packing(policy: Policy, train) -> None:
    """Packed micro-batches (train.packing with a token budget) need the packed attention function, which
    build_policy installs in place of sdpa, and full causal attention: refuse another attention
    implementation or sliding-window layers in one line rather than let sequences see each other."""
    if not (train.packing and train.micro_batch_tokens > 0):
        return
    config = policy.lm.config
    if not config._attn_implementation.startswith(PACKED_ATTENTION):
        raise ModelError(f"train.packing: packed sequences need sdpa attention, {type(policy.lm).__name__} runs "
                         f"{config._attn_implementation!r}; set train.packing=false")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                              or []):
        raise ModelError(f"train.packing: {type(policy.lm).__name__} has sliding-window attention layers, which "
                         "packed rows do not support; set train.packing=false")


def disable_dropout(lm: torch.nn.Module) -> None:
    """Dropout off everywhere, as RL fine-tuning codes do: the update runs in train mode (for
    checkpointing) while π_old, π_ref and generation run in eval mode, and dropout would make the
    two disagree (ρ != 1 on the first iteration). Covers nn.Dropout modules and the attention
    dropout rate transformers passes to its attention kernels."""
    for module in lm.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if isinstance(getattr(lm.config, key, None), float):
            setattr(lm.config, key, 0.0)


def check_context(config, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """data.max_prompt_tokens + rollout.max_new_tokens must fit the model's positions."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_prompt_tokens + max_new_tokens > limit:
        raise ModelError(f"data.max_prompt_tokens ({max_prompt_tokens}) + rollout.max_new_tokens "
                         f"({max_new_tokens}) = {max_prompt_tokens + max_new_tokens} exceeds the model's "
                         f"max_position_embeddings ({limit}); lower one of them")


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's rule, op by op inside a decoder layer: keep the outputs of the attention
    kernel (sdpa's flash, memory-efficient or cuDNN kernels, varlen) and of the matrix multiplies (a
    linear layer is mm or addmm) over an inner dimension of at least SAVED_MATMUL_INNER, recompute
    everything else in backward (the norms, RoPE, SiLU and the product, the casts, KV heads repeated, a
    LoRA adapter's rank-r up-projection): no projection of the model runs twice."""
    name = op.name()                                    # "aten::mm", "torch_attn::_varlen_attn", ...
    if "attention" in name or "attn" in name:
        return CheckpointPolicy.MUST_SAVE
    if op in SAVED_MATMULS and args[op is torch.ops.aten.addmm.default].shape[-1] >= SAVED_MATMUL_INNER:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVED_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
# a matmul's recompute costs 2 x its inner dimension in FLOPs per output element: worth keeping its output
# (2 bytes under bf16) from 128 on; a LoRA adapter's B (inner dimension: the rank) is recomputed instead
SAVED_MATMUL_INNER = 128


def enable_checkpointing(lm: torch.nn.Module, mode: str | bool) -> None:
    """Activation checkpointing of each decoder layer, through transformers (non-reentrant, so it works
    under FSDP2 and with frozen inputs; transformers recomputes only in train mode):
    - full: the layer keeps only its input; backward runs its whole forward again;
    - selective: torch's selective activation checkpointing (`create_selective_checkpoint_contexts`) with
      `save_matmuls`: the layer also keeps its matmul and attention outputs, and backward recomputes
      only the elementwise ops between them;
    - none: everything is kept. True / False (older configs): full / none.
    docs/gpu.md#plan counts what each mode keeps."""
    mode = {True: "full", False: "none"}.get(mode, mode)
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"gradient_checkpointing: expected none, selective or full, got {mode!r} "
                         "(auto is resolved by the memory plan)")
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_policy(path: str, *, trust_remote_code: bool = False, chunk_tokens: int, bf16: bool = False,
                 gradient_checkpointing: str | bool = "none", trainable: bool = True,
                 lora: LoraConfig | None = None) -> Policy:
    """The trainable policy, or (trainable=False) a frozen reference. Both start in eval mode.

    gradient_checkpointing: none | selective | full (`enable_checkpointing`; True / False: full / none),
    resolved: model.gradient_checkpointing=auto is the memory plan's choice (plan.py: startup_check).
    The training loop switches the policy to train mode for the update only: transformers
    recomputes checkpointed layers only when `self.training`, and a checkpointed layer in train
    mode drops the KV cache, so generation and scoring must run in eval mode.
    lora (rank > 0): peft adapters on a frozen base (lora.py), held in bf16 under model.bf16; the
    PeftModel is `policy.peft` (None without adapters).
    It scores with torch's choice of sdpa kernel per call, eager layers and the eager head until
    configure_scoring (or set_scoring) says otherwise.
    """
    lora = lora if lora is not None and lora.rank > 0 and trainable else None
    lm = load_causal_lm(path, trust_remote_code, torch.bfloat16 if lora and bf16 else torch.float32)
    if lm.config._attn_implementation == "sdpa":
        pin_kernels(lm, UNPINNED)              # sdpa, and packed sequences (packed_attention.py)
    check_plain_head(lm)
    disable_dropout(lm)
    if trainable:
        enable_checkpointing(lm, gradient_checkpointing)
    peft_model = add_adapters(lm, lora) if lora else None                   # in place: lm holds them
    policy = Policy(lm, chunk_tokens, bf16).eval()
    object.__setattr__(policy, "peft", peft_model)                          # not a submodule: lm is
    if not trainable:
        policy.requires_grad_(False)
    return policy


def configure_scoring(policy: Policy, cfg: Config, kernels: Kernels, device: torch.device) -> None:
    """The settings of how the policy scores, resolved on the run's device: the attention `kernels`
    (train.attention, chosen at start-up), train.compile and model.logprob_head. Before sharding."""
    set_scoring(policy, kernels=kernels, compiled=compiled_layers(cfg.train.compile, device),
                head=head_mode(cfg.model.logprob_head, device))


def set_scoring(policy: Policy, *, kernels: Kernels, compiled: bool, head: str) -> None:
    """Pin the attention kernels (packed_attention.pin_kernels), compile each decoder layer (compile_layers:
    after LoRA's adapters, which the layers then hold, and before FSDP2 shards them) and choose the
    log-prob head (token_logprobs.py)."""
    if policy.lm.config._attn_implementation.startswith(PACKED_ATTENTION):
        pin_kernels(policy.lm, kernels)
    if compiled:
        compile_layers(policy.lm)
    policy.head = head


def decoder_layers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, found by its own `_no_split_modules` class names (any transformers
    architecture); ValueError if it names none that it holds."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers ({sorted(names)}) in {type(lm).__name__}")
    return layers


def compile_layers(lm: torch.nn.Module) -> None:
    """Each decoder layer's forward compiled for scoring passes (torch.compile, dynamic shapes), before
    FSDP2 shards the layer (distributed.shard), as torchtitan compiles each block and then applies
    fully_shard.

    Only forward is replaced, so the layer's hooks run around the compiled code: FSDP2's all-gathers
    and transformers' gradient checkpointing (which recomputes through the compiled forward); the
    parameters keep their names (checkpoints, the engine sync). Inductor fuses what the profile showed
    as separate elementwise kernels: the norms, the rotary embedding, the MLP's activation and the
    residual adds. Micro-batches change length every step: with dynamic shapes the layers compile once
    for each kind of pass (packed or unpacked rows, train or eval mode, with or without grad), shared
    by all layers; the attention runs between the compiled graphs, outside them (packed_attention.py).
    Generation (a pass with a KV cache) runs the layer eagerly: its loop compiles its own step
    (rollout.compile), and the decoding twin (engines/decode.py), a deep copy, gets this forward bound
    to its own layers. A compile that fails runs the layers eagerly from then on (compiled.py's rule). The
    graphs do not depend on the number of layers (tests/components/test_model.py): graphs per layer would
    pass dynamo's recompile limit on a deep model.
    """
    for layer in decoder_layers(lm):
        layer.forward = types.MethodType(_scoring_forward, layer)


def _scoring_forward(layer: torch.nn.Module, *args, **kwargs):
    """A decoder layer's forward: compiled without a KV cache (scoring), eager with one (generation)."""
    forward = type(layer).forward
    if kwargs.get("past_key_values") is not None:
        return forward(layer, *args, **kwargs)
    return _compiled(forward)(layer, *args, **kwargs)


@functools.cache
def _compiled(forward) -> Compiled:
    """A decoder layer class's forward, compiled once per process (shared by its layers and policies)."""
    return Compiled(forward, path=f"decoder layers ({forward.__qualname__})", off="train.compile=never",
                    dynamic=True)


def compiled_layers(setting: str, device: torch.device) -> bool:
    """train.compile resolved: auto compiles on CUDA only (on CPU, bench/micro_batches.py --compile
    measured no gain: docs/gpu.md, "The update's speed"); always; never."""
    return setting == "always" or (setting == "auto" and device.type == "cuda")


def compile_line(compile_setting: str, head_setting: str, device: torch.device) -> str:
    """The start-up line naming how scoring runs: compiled layers or eager, and the log-prob head."""
    layers = "compiled" if compiled_layers(compile_setting, device) else "eager"
    return (f"scoring: decoder layers {layers} (train.compile={compile_setting}), log-prob head "
            f"{head_mode(head_setting, device)} (model.logprob_head={head_setting})")


def attention_heads(config) -> dict[str, int]:
    """A transformers config's attention shape, as packed_attention.choose_kernels probes it."""
    heads = config.num_attention_heads
    return {"heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


def head_mode(setting: str, device: torch.device) -> str:
    """model.logprob_head resolved: auto is compiled on CUDA, eager elsewhere (bench/logprob_head.py)."""
    if setting == "auto":
        return "compiled" if device.type == "cuda" else "eager"
    return setting
