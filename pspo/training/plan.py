"""Will it fit? A per-GPU memory plan of a training run, from the model's config.json alone (docs/gpu.md#plan).

    python train.py --config X --plan [--gpus=8] [--gpu_gib=80]     # table; no GPU, no download

train.py's start-up prints the same plan in one line and stops (exit 2) when it cannot fit; it also
resolves model.gradient_checkpointing=auto there (`startup_check`): the first of none, selective, full
whose plan fits (`make_plan`), none on CPU. Counted per GPU, for FSDP2 over N GPUs
(distributed.shard) with float32 master weights (model.py) and bf16 autocast when model.bf16:
- parameters, gradients (fp32) and AdamW's m and v (2 x fp32), each sharded 1/N, and the frozen
  reference model when algo.beta > 0 or REINFORCE++'s kl_coef > 0 (built like the policy: fp32, sharded 1/N);
- FSDP2's unsharded parameters in flight (N > 1): the root (embeddings, final norm, an untied
  head) stays gathered from forward to backward, with its unsharded gradient; two decoder layers
  (the current one and the prefetched next) and one layer's unsharded gradient;
- the update's largest micro-batch (`micro_batch_shape`) at its peak moment (`micro_batch_moments`:
  the head's forward and backward, a layer's backward, the embedding's), what each layer keeps for
  the checkpointing mode (`layer_bytes`), and UPDATE_MARGIN; `update_peak` plans an explicit batch;
- vLLM (rollout.engine vllm, or auto on a GPU): rollout.gpu_memory_utilization x the GPU, its
  weights in bf16 and a KV cache in the rest (less vLLM's own profiled activations, not counted).
  rollout.sleep frees it during the update (level 1: weights to CPU, KV cache dropped);
- transformers (rollout.engine hf), one GPU: decode.py's static-cache loop keeps, in both phases, its
  KV cache (2 x layers x KV heads x head_dim x 2 B in bf16 or 4 B in float32, per position) at the
  largest shape the run asks for: rows bucketed (tokens.bucket) up to rollout.batch_size, positions a
  multiple of data.max_prompt_tokens + rollout.max_new_tokens (`static_cache_shape`, over the step's
  generate calls and the evaluation's), and with model.bf16 its twin's bf16 copies of the linear
  layers (2 B x `Arch.linear_params`); generation adds its working set (`decode_bytes`: the prefill's
  top-layer MLP or the sampler's step, the larger) for the rows in flight (`step_shape`: G per prompt,
  and SPO's continuations: up to b0·b1·b2 per prompt at once for SPO-tree, G·ceil(T/K)·N for
  SPO-chain, in chunks of rollout.batch_size rows);
- transformers over N > 1 GPUs (`generate` on the sharded policy, dynamic cache): the KV cache and
  working set of the rows in flight in the largest generate call, autocast's bf16 weight copies and
  the gathered FSDP2 parameters, during generation;
- rollout.mode=async (`engine_placement`): engine processes on rollout.engine_gpus, one each, or all
  on GPU 0 beside trainer rank 0 when it is empty; every GPU the run places something on is planned
  (`Plan.others`, `Plan.where`). An engine generates during the update too, so it counts in both
  phases: vLLM its share each; an hf engine its own model copy, its twin's bf16 copies, its KV cache
  and working set at its slice of the step (`engine_call`), its allocator's cache and
  ENGINE_OVERHEAD_GIB (`engine_rows`). The trainer generates no training rollout; it evaluates with
  the transformers engine on the policy, whose decoder is built at its first call, so it is counted
  only when the run evaluates (data.eval: `eval_calls`), and it stages the weights at each launch
  (`staging_rows`: a gathered tensor under FSDP2, the sync check's row sums);
- the caching allocator: what it *reserves* beyond what the tensors hold, ALLOCATOR_SLACK x the
  larger phase's PyTorch tensors (vLLM's share, the engine processes' and the constant below left
  out: each engine process has its own allocator, planned in its rows). It rounds every
  block up (512 B below 1 MiB), keeps freed blocks cached for reuse, and the blocks of one step vary
  in size (micro-batches of other lengths, the log-prob blocks), so segments hold holes no later
  request fits; a block cached in the update is still reserved in the next generation (only a waking
  vLLM empties the cache). Measured reserved / allocated: 1.07-1.21 for bench/micro_batches.py's 1.5B
  update, 1.24 for the 1.5B GRPO recipe end to end (bench/RESULTS.md §20, §22, §24);
- PSPO*'s process reward model (reward.prm != 0, docs/related.md §C): its bf16 weights, a whole copy
  per GPU, and one scoring forward of prm.batch_tokens tokens in the generation phase (no grad: about
  the hidden states, q, k, v and the MLP's intermediate of those tokens alive at once, (6H + 2I) x 2 B
  per token);
- OVERHEAD_GIB for the CUDA context and NCCL, outside PyTorch's allocator.
The peak is the larger phase: generation (weights, Adam state, the KL reference, the engine; gradients
were freed by zero_grad(set_to_none)) or update (all training state, the micro-batch's peak moment,
vLLM unless it sleeps). `Plan.tensors` is the figure torch.cuda.max_memory_allocated should reach
in the trainer's process.

Attention assumed: flash kernels (varlen for packed rows, sdpa's flash or cuDNN kernels unpacked:
the update runs without a mask, model.py), which keep q, k, v, the output and the log-sum-exp, no
(heads x s x s) matrix; the KV heads counted repeated to every head, as varlen attention without a GQA
switch needs (an upper bound elsewhere). tests/components/test_plan.py checks each count against what
a real-width Qwen2 layer keeps on CPU, the whole update's peak against a measured one, and an hf engine
process's rows, the evaluation engine's and the staging's against what they allocate.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from pspo.training.config import (CHECKPOINTING, Config, ConfigError, LoraConfig, error_line, first_line,
                                  load_config, parse_ints)
from pspo.training.micro_batches import MicroBatch
from pspo.training.model import load_model_config
from pspo.training.tokens import bucket

SPARE = 1          # the KV cache's spare column past its length, engines/decode.py's (a test holds them equal)

GiB = 2**30
Resolve = Callable[[str], str]      # a model name -> its folder (offline/builtin.py: resolve_model_path)
OVERHEAD_GIB = 2.0        # CUDA context (~0.5 GiB), NCCL workspaces: outside PyTorch's allocator
# PyTorch's caching allocator: what it reserves beyond the tensors, as a share of them (the most measured:
# 43.0 reserved / 34.6 allocated = 1.243, bench/RESULTS.md §20)
ALLOCATOR_SLACK = 0.25
# the update's tensors the moments do not list (cuBLAS / cuBLASLt workspaces, 32 MiB each on Hopper; the
# batch, the loss's per-token tensors, the norms' fp32 temporaries): the gap the moments left below the
# measured peak of bench/RESULTS.md §24 (0.1-0.3 GiB)
UPDATE_MARGIN = 2**28
# the sampler's working set per generated row at its peak, the Gumbel noise's hash: 11 float32 (vocab,) blocks (the
# logits, logits/T and their log_softmax, four int64 blocks of the hash), as measured on CPU, eager
# (tests/components/test_plan.py). Three int64 blocks in a fresh process; four after a compile failed in the
# process (the eager fallback): dynamo's frame evaluator, left installed, makes a caller hold the hash's argument
# through the call. A compiled sampler fuses the hash.
SAMPLER_BLOCKS = 11
# an engine process's memory outside PyTorch's allocator: its own CUDA context (~0.5 GiB) and cuBLAS workspaces
# (no NCCL): a rough figure, like OVERHEAD_GIB
ENGINE_OVERHEAD_GIB = 1.0
ENGINE = "engine"         # the key prefix of an engine process's rows: its own allocator, outside Plan.tensors
DEFAULT_GPUS, DEFAULT_GPU_GIB = 8, 80.0
USAGE = (f"usage: train.py --config FILE.yaml --plan [--gpus=N] [--gpu_gib=G] [--section.key=value ...] "
         f"(defaults: {DEFAULT_GPUS} GPUs of {DEFAULT_GPU_GIB:g} GiB; an '80 GB' H100 has 79.2 GiB)")


class PlanError(ConfigError):
    """The run cannot fit, or no architecture to plan from; one line (train.py: exit code 2)."""


@dataclass(frozen=True)
class Arch:
    """What the plan needs from config.json; parameter counts from a model built on the meta device."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int          # all parameters, tied embeddings counted once
    layer_params: int    # one decoder layer (an FSDP2 unit)

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and an untied head: the root FSDP2 unit."""
        return self.params - self.layers * self.layer_params

    @property
    def tied(self) -> bool:
        """The output head is the input embedding (tie_word_embeddings): the root holds one vocab x hidden."""
        return self.root_params < 2 * self.vocab * self.hidden

    @property
    def linear_params(self) -> int:
        """The weights and biases of the linear layers, the head included (tied or not): what the decoder's twin
        copies to bf16 (decode.py: decode_twin). A layer is its linear layers and two RMSNorms of H."""
        return self.layers * (self.layer_params - 2 * self.hidden) + self.vocab * self.hidden

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter: the embedding (vocab x H) or an MLP projection (H x I)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def arch_from_config(config, trust_remote_code: bool = False) -> Arch:
    """A transformers config -> Arch (a decoder-only transformer: RMSNorm, gated MLP, GQA)."""
    fields = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(getattr(config, key, None), int):
            raise PlanError(f"model.name_or_path: its config.json has no integer {key}, cannot plan memory")
        fields[key] = getattr(config, key)
    try:
        with torch.device("meta"):                                      # shapes only, no memory
            lm = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, ImportError) as e:
        raise PlanError(f"model.name_or_path: cannot build {config.model_type!r} from its config.json "
                        f"({first_line(e, 200)})") from None
    layer_names = set(getattr(lm, "_no_split_modules", None) or [])
    layer = next((m for m in lm.modules() if type(m).__name__ in layer_names), None)
    if layer is None:
        raise PlanError(f"model.name_or_path: cannot find the decoder layers ({sorted(layer_names)}) "
                        f"of {config.model_type!r}")
    heads = fields["num_attention_heads"]
    return Arch(fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"], heads,
                getattr(config, "num_key_value_heads", None) or heads,
                getattr(config, "head_dim", None) or fields["hidden_size"] // heads, fields["vocab_size"],
                sum(p.numel() for p in lm.parameters()),
                sum(p.numel() for p in layer.parameters()))


def load_arch(path: str, config_file: str, trust_remote_code: bool = False) -> tuple[Arch, str]:
    """(Arch, where its config.json came from), offline. `path`: model.name_or_path resolved (a built-in
    name is its cached folder). Looked for in order: a local folder; a hub id in the local Hugging
    Face cache; the stand-in `model_config.json` next to the YAML config_file."""
    standin = os.path.join(os.path.dirname(os.path.abspath(config_file)), "model_config.json")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise PlanError(f"model.name_or_path: {path} has no config.json")
        candidates = [(path, path)]
    else:
        candidates = [(path, f"{path} (local Hugging Face cache)")]
        # The stand-in describes the model its recipe folder is named for (configs/qwen2.5-math-1.5b/
        # <-> Qwen/Qwen2.5-Math-1.5B): another hub id must not borrow it and get a wrong plan.
        recipe_model = os.path.basename(os.path.dirname(os.path.abspath(config_file))).lower()
        if (os.path.isfile(standin) and re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", path)
                and path.rsplit("/", 1)[1].lower() == recipe_model):
            candidates.append((standin, f"{os.path.relpath(standin)} (stand-in for {path})"))
    for source, label in candidates:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True,
                                                trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - not cached (OSError), or a config.json transformers rejects
            if source != standin and not os.path.isdir(source):
                continue                                        # not in the cache: try the stand-in
            first = first_line(e, 200)
            raise PlanError(f"model.name_or_path: cannot read {source}'s config.json ({first})") from None
        return arch_from_config(config, trust_remote_code), label
    fallback = ""
    if not os.path.isfile(standin):
        fallback = f" (a hub id falls back to {os.path.relpath(standin)}: absent)"
    raise PlanError(f"model.name_or_path: no config.json for {path!r}: not a local folder nor in the "
                    f"local Hugging Face cache{fallback}")


@dataclass(frozen=True)
class PRMArch:
    """What the plan needs of the process reward model (docs/related.md §C)."""
    params: int
    hidden: int
    intermediate: int


def load_prm_arch(cfg: Config, *, local_only: bool, resolve: Resolve) -> tuple[PRMArch | None, str]:
    """(PRMArch, "") of prm.model's config.json, or (None, why) when reward.prm is 0 or it cannot be read
    (local_only: the `--plan` command, no download)."""
    if cfg.reward.prm == 0:
        return None, ""
    remote = cfg.prm.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(resolve(cfg.prm.model), local_files_only=local_only,
                                            trust_remote_code=remote)
        with torch.device("meta"):                                      # shapes only, no memory
            model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=remote)
    except Exception as e:  # noqa: BLE001 - not a local folder nor cached, or not a classifier
        why = first_line(e, 120)
        return None, f"prm.model {cfg.prm.model!r}: not counted, its config.json cannot be read ({why})"
    hidden = getattr(config, "hidden_size", 0)
    return PRMArch(sum(p.numel() for p in model.parameters()), hidden,
                   getattr(config, "intermediate_size", 0) or 4 * hidden), ""


def layer_bytes(a: Arch, *, bf16: bool, checkpointing: str) -> int:
    """Bytes per token one decoder layer keeps from its forward to its backward (model.py:
    enable_checkpointing). H hidden, I intermediate, q = heads x head_dim, kv = KV heads x head_dim;
    the residual stream and RMSNorm in fp32, the matmuls in bf16 under model.bf16.
    - none, bf16: both norms' input and normalized 4 x 4H; the bf16 casts of their outputs for the q,
      k, v, gate, up projections 5 x 2H; attention q, k, v (KV heads repeated to all heads, as varlen
      attention without a GQA switch needs: an upper bound) and output 4 x 2q; gate, SiLU, up,
      product 4 x 2I; log-sum-exp 4 x heads; both norms' rsqrt 2 x 4.
      fp32: both norms' input, normalized and output 6 x 4H; attention 4 x 4q; MLP 4 x 4I; the same.
    - selective: the layer's fp32 input 4H; the matmul outputs q, k, v (q + 2kv), o and down (2 x H),
      gate and up (2 x I), at 2 bytes (bf16) or 4; the attention output (2 or 4 x q) and log-sum-exp.
    - full: the layer's fp32 input only, 4H.
    Autocast's bf16 weight copies are not in these: `micro_batch_moments` counts them.
    tests/components/test_plan.py checks each against what a real-width Qwen2 layer keeps on CPU."""
    H, I, q, kv = a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim
    w = 2 if bf16 else 4                                                # bytes of a matmul's output
    if checkpointing == "full":
        return 4 * H
    if checkpointing == "selective":
        return 4 * H + w * (q + 2 * kv + 2 * H + 2 * I + q) + 4 * a.heads
    if checkpointing != "none":
        raise ValueError(f"checkpointing: expected none, selective or full, got {checkpointing!r}")
    per_token = 26 * H + 8 * q + 8 * I if bf16 else 24 * H + 16 * q + 16 * I
    return per_token + 4 * a.heads + 8


def layer_backward_bytes(a: Arch, bf16: bool) -> int:
    """Bytes per token a decoder layer's backward adds while its saved tensors are still alive: the
    fp32 gradient of the residual stream in and out (2 x 4H) and, at the MLP (the first op in
    backward), the gradients of its product, SiLU output and up projection before the product is
    freed (3 x 2I in bf16, 3 x 4I in fp32)."""
    return 8 * a.hidden + (6 if bf16 else 12) * a.intermediate


def weight_grad_bytes(a: Arch, bf16: bool) -> int:
    """An MLP projection's fresh gradient (H x I) before it is added into its .grad: fp32, and under
    bf16 autocast also the bf16 gradient of the weight's bf16 copy it is cast from."""
    return (6 if bf16 else 4) * a.hidden * a.intermediate


def head_saved_bytes(a: Arch, tokens: int, completion: int) -> int:
    """What the forward outside the decoder layers keeps for backward: per position the final norm's
    input, normalized value and output (12H, the output kept by the gather that picks the completion
    positions), RoPE's cos and sin (8 x head_dim) and the ids (16); per completion token the log-prob
    head's copy of its hidden state (4H) and its log-sum-exp and log-prob (16)."""
    return tokens * (12 * a.hidden + 8 * a.head_dim + 16) + completion * (4 * a.hidden + 16)


def head_bytes(a: Arch, chunk_tokens: int, *, bf16: bool, trains_head: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes of the log-prob head (token_logprobs.py) at its largest, for blocks of
    chunk_tokens (k) tokens x vocab (V); H hidden.
    forward: two (k x V) fp32 blocks (the logits, then their exp), and under bf16 W's bf16 copy (2VH).
    backward: one fp32 block; under bf16 its bf16 copy (2 bytes), W's bf16 copy, and one fp32 (V x H)
    product before it is added in; and the head's fp32 gradient (4VH) when it trains (not LoRA's
    frozen head, whose bf16 weight needs no copy either)."""
    block, head = chunk_tokens * a.vocab, a.vocab * a.hidden
    copy = 2 * head if bf16 and trains_head else 0
    forward = 2 * 4 * block + copy
    if not bf16:
        return forward, 4 * block + (4 * head if trains_head else 0)
    return forward, 6 * block + copy + (8 * head if trains_head else 0)


def micro_batch_moments(a: Arch, *, tokens: int, completion: int, bf16: bool, checkpointing: str,
                        chunk_tokens: int, grads: int, first: bool = False, lora: bool = False,
                        gpus: int = 1) -> dict[str, int]:
    """Bytes one micro-batch holds above the weights and AdamW state at each moment its forward and
    backward peak, gradients included; its peak is the largest (docs/gpu.md#plan).

    tokens: the positions the model runs over (a packed row's tokens; rows x the longest row unpacked);
    completion: the positions the head scores; grads: the bytes of all gradients, alive from the first
    backward to the optimizer step; first: the update's first micro-batch (the largest: micro_batches.py
    packs the longest first), which starts with none. With L layers, each keeping `layer_bytes` per
    token, K = L x layer_bytes x tokens, and C the bf16 copies of the decoder's weights autocast makes
    (2 B x L x layer parameters; 0 in float32, for LoRA's bf16 base, whose adapters are small, and under
    FSDP2, gpus > 1, whose bf16 parameters are gathered a layer at a time: the fsdp row):
    - head forward, the end of the forward: K, `head_saved_bytes`, C (kept for backward without
      checkpointing, else in autocast's cast cache, which lives until the forward ends), the head's
      forward blocks;
    - head backward, the start of the backward: K, the head's saved tensors, C without checkpointing,
      the head's backward blocks and the fp32 gradient of its hidden states (4H per completion token);
    - the last layer's backward: the layers' K (of the head's tensors only RoPE's are left), C without
      checkpointing, and with it that layer recomputed (its tensors as without checkpointing and its
      weights' bf16 copies), plus `layer_backward_bytes` and `weight_grad_bytes`. A tied head's
      gradient waits in autograd's buffer for the embedding's until the backward ends (4 x vocab x H).
      In the first micro-batch the gradients grow as the layers' tensors are freed: its largest layer
      moment is the top layer's (every layer's tensors; the head's gradient and the top layer's down
      projection's) or the bottom layer's (its own tensors; every gradient but the embedding's and its
      own, bar its down projection's);
    - the embedding's backward (full fine-tuning): every gradient, its dense fp32 (vocab x H) gradient
      (tied: with the head's waiting one and their sum, 3 of them), and the fp32 gradient of the
      embedding output (2 x 4H per token).
    """
    L, per_token = a.layers, layer_bytes(a, bf16=bf16, checkpointing=checkpointing)
    copies = 2 * a.layer_params if bf16 and not lora and gpus == 1 else 0   # one layer's weights in bf16
    kept = L * per_token * tokens
    head_forward, head_backward = head_bytes(a, min(chunk_tokens, max(1, completion)), bf16=bf16,
                                             trains_head=not lora)
    before = 0 if first else grads
    head_grad = 0 if lora else 4 * a.vocab * a.hidden
    recompute = 0
    if checkpointing != "none":                  # the layer runs again, keeping what it keeps without
        recompute = (layer_bytes(a, bf16=bf16, checkpointing="none") - per_token) * tokens + copies

    def layer_backward(j: int) -> int:
        """The backward of the j-th layer from the top (j = 0 runs first): the layers below still keep
        their tensors; in the first micro-batch the gradients so far are the head's, the j layers above's
        and this layer's down projection's (its first)."""
        done = grads + (head_grad if a.tied else 0)                # a tied head's gradient waits (above)
        if first:
            done = min(grads, head_grad + 4 * j * a.layer_params + 4 * a.hidden * a.intermediate)
        left = L - j
        saved = left * (per_token * tokens + (copies if checkpointing == "none" else 0))
        return (done + saved + 8 * a.head_dim * tokens + recompute + layer_backward_bytes(a, bf16) * tokens
                + weight_grad_bytes(a, bf16))
    moments = {
        "head forward": before + kept + head_saved_bytes(a, tokens, completion) + L * copies + head_forward,
        "head backward": (before + kept + head_saved_bytes(a, tokens, completion) + head_backward
                          + (L * copies if checkpointing == "none" else 0) + 4 * a.hidden * completion),
        "layer backward": max(layer_backward(0), layer_backward(L - 1))}
    if not lora:
        moments["embedding backward"] = grads + (3 if a.tied else 1) * head_grad + 8 * a.hidden * tokens
    return moments


def micro_batch_peak(a: Arch, **shape) -> tuple[int, str]:
    """(bytes, the moment) of micro_batch_moments at its largest."""
    moments = micro_batch_moments(a, **shape)
    moment = max(moments, key=moments.get)
    return moments[moment], moment


def update_peak(a: Arch, micro_batches: list[tuple[int, int]], *, bf16: bool, checkpointing: str,
                chunk_tokens: int) -> int:
    """What one GPU allocates at the peak of a full fine-tuning update of these micro-batches, in the
    order it runs them, each (positions, completion positions the head scores), as bench/micro_batches.py
    runs it: the fp32 parameters, AdamW's m and v (12 B per parameter; the fused optimizer adds
    nothing), and the largest moment of its micro-batches, gradients (4 B per parameter) included.
    Comparable with torch.cuda.max_memory_allocated; UPDATE_MARGIN added."""
    peaks = [micro_batch_peak(a, tokens=n, completion=c, bf16=bf16, checkpointing=checkpointing,
                              chunk_tokens=chunk_tokens, grads=4 * a.params, first=i == 0)[0]
             for i, (n, c) in enumerate(micro_batches)]
    return 12 * a.params + max(peaks) + UPDATE_MARGIN


def micro_batch_sizes(batches: list[MicroBatch]) -> list[tuple[int, int]]:
    """(positions, completion positions) of each micro-batch as Policy.forward runs it: a packed row's
    tokens and completion tokens; unpacked, rows x (the longest row - 1) positions (the last token
    predicts nothing) and rows x its completion columns scored. The input of `update_peak`."""
    return [(b.packed.tokens, b.packed.completion_tokens) if b.packed else
            (len(b.rows) * max(1, b.length - 1), len(b.rows) * b.width) for b in batches]


def device_bytes(tensors: int) -> int:
    """What a GPU must hold for `tensors` bytes of PyTorch tensors: the caching allocator's share
    (ALLOCATOR_SLACK) and the constant outside it (OVERHEAD_GIB), as a plan adds them."""
    return tensors + int(ALLOCATOR_SLACK * tensors) + int(OVERHEAD_GIB * GiB)


def kv_bytes_per_token(a: Arch, dtype_bytes: int = 2) -> int:
    """vLLM's KV cache per token: K and V x layers x KV heads x head_dim x dtype bytes."""
    return 2 * a.layers * a.kv_heads * a.head_dim * dtype_bytes


def static_cache_bytes(a: Arch, rows: int, length: int, bf16: bool) -> int:
    """The static-cache loop's KV cache (decode.py: StaticKV): 2 (K, V) x layers x KV heads x head_dim x bytes
    (2 under bf16 autocast, else 4) x rows x (positions + SPARE, the spare column it holds)."""
    return kv_bytes_per_token(a, 2 if bf16 else 4) * rows * (length + SPARE)


def decode_bytes(a: Arch, rows: int, width: int, new_tokens: int, bf16: bool, lora: bool = False) -> int:
    """What the transformers engine's loop (decode.py) allocates while it generates, beside the weights and the
    KV cache: `rows` rows of `width` padded input tokens and up to `new_tokens` new ones, at the larger of its
    two moments (measured on CPU by tests/components/test_plan.py), plus what it keeps for the call's end.
    - the prefill, in the top layer's MLP: per input token four float32 (H,) hidden states (the embeddings,
      the layer's input, the residual after attention, the normalized input: 16H), RoPE's cos and sin in
      float32 (8 x head_dim), the MLP's activation, up projection and their product (3 x I, in bf16 under
      model.bf16, else float32; under LoRA a fourth, the adapter's output before it is added in), the prefill
      mask's row (W bools) and the int64 copies of the ids, the mask and the positions (5 x 8); and once its
      causal and diagonal (W, W) masks (2 W^2 bools);
    - a decoding step: the sampler's SAMPLER_BLOCKS float32 (vocab,) blocks per row and the vocabulary's
      hash keys (8 B x vocab);
    - kept for the call: per row its new tokens (int64) and their log-probs (float32), 12 B each, and its
      key mask over the cache (bools) and about 16 int64 (positions, order, budgets, seeds, draws: 128); a few
      int64 scalars (64)."""
    w, mlp = 2 if bf16 else 4, 4 if lora else 3
    prefill = rows * width * (16 * a.hidden + 8 * a.head_dim + mlp * w * a.intermediate + width + 40) + 2 * width**2
    step = rows * SAMPLER_BLOCKS * 4 * a.vocab + 8 * a.vocab
    return max(prefill, step) + rows * (12 * new_tokens + width + new_tokens + SPARE + 128) + 64


@dataclass(frozen=True)
class GenerateCall:
    """One engine.generate call of a training step on one GPU, at its largest."""
    inputs: int       # prompts, or partial completions to continue
    n: int            # samples of each input
    longest: int      # tokens of the longest row the transformers engine holds: padded input + budget
    width: int        # tokens of the longest padded input (a prompt, or a prompt and the prefix continued)

    @property
    def sequences(self) -> int:
        return self.inputs * self.n


@dataclass(frozen=True)
class StepShape:
    """What one training step of the configured method holds on one GPU."""
    calls: list[GenerateCall]       # its generate calls, in order
    update_rows: int                # the rows its optimizer step trains at most


def step_shape(cfg: Config, prompts: int) -> StepShape:
    """The generate calls and update rows of one step on a GPU holding `prompts` prompts: the one place
    the plan reads algo.advantage (docs/related.md §B for SPO).

    P_max = data.max_prompt_tokens, T = rollout.max_new_tokens.
    - per-completion methods (GRPO, REINFORCE++, Single-stream PO): G completions of each prompt, P_max + T
      tokens (Single-stream PO also scores its revisited prompts' stored completions: a forward pass over at
      most the step's rows, below the update's peak).
    - spo_chain: then spo.num_mc (N) continuations of each distinct cut state. Cuts are every K-th
      token with p_t < 0.9 (K = spo.cutpoint_interval), so at most ceil(T / K) per completion and
      G·ceil(T/K) states per prompt: G·(1 + ceil(T/K)·N) sequences per prompt in all. The
      transformers engine pads a chunk of states to its longest prompt + prefix (up to P_max + T - 1)
      and runs every row to the chunk's largest budget (up to T, the state before the first token):
      a row holds up to P_max + 2T - 1 tokens.
    - spo_tree: b0 completions of M0 tokens, b1 continuations of each to M0 + M1 tokens, b2 of those
      to T: up to b0·b1·b2 sequences per prompt in the last call, b0·(1 + b1 + b1·b2) in all.
    The update trains the step's G completions of each prompt; SPO-tree trains replayed edges instead,
    at most train.micro_batch_size rows (as many as it draws).
    """
    r, s, P_max, T = cfg.rollout, cfg.spo, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    first = GenerateCall(prompts, r.num_generations, P_max + T, P_max)
    if cfg.algo.advantage == "spo_tree":
        b0, b1, b2 = s.branch_factors
        m0, m1 = s.segments
        calls = [GenerateCall(prompts, b0, P_max + m0, P_max),
                 GenerateCall(prompts * b0, b1, P_max + m0 + m1, P_max + m0),
                 GenerateCall(prompts * b0 * b1, b2, P_max + T, P_max + m0 + m1)]
        return StepShape(calls, cfg.train.micro_batch_size)
    if cfg.algo.advantage == "spo_chain":
        cuts = -(-T // s.cutpoint_interval)                                 # ceil(T / K) per completion
        states = GenerateCall(prompts * r.num_generations * cuts, s.num_mc, P_max + 2 * T - 1, P_max + T - 1)
        return StepShape([first, states], first.sequences)
    return StepShape([first], first.sequences)


def eval_calls(cfg: Config) -> list[GenerateCall]:
    """The evaluation's generate calls on one GPU at their largest (evaluation.py): eval.batch_size prompts,
    greedy, then eval.num_samples samples of each; none when the run does not evaluate (data.eval empty)."""
    P_max, T = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    if not cfg.data.eval:
        return []
    return [GenerateCall(cfg.eval.batch_size, n, P_max + T, P_max) for n in (1, cfg.eval.num_samples) if n > 0]


def engine_call(cfg: Config) -> GenerateCall:
    """The generate call of one engine process (rollout.mode=async): its slice of the step's
    train.prompts_per_step prompts (engines/schedule.py: split, the first slices the larger), G each."""
    P_max, T, B = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.train.prompts_per_step
    return GenerateCall(-(-B // cfg.rollout.engines), cfg.rollout.num_generations, P_max + T, P_max)


def rows_in_flight(call: GenerateCall, batch_size: int) -> int:
    """Rows the transformers engine generates at once: HFEngine.generate runs chunks of
    max(1, rollout.batch_size // n) inputs, n rows each (so at least n rows, even above batch_size)."""
    return min(call.inputs, max(1, batch_size // call.n)) * call.n


def static_cache_shape(cfg: Config, calls: list[GenerateCall]) -> tuple[int, int]:
    """(rows, positions) of the static-cache loop's KV buffer at its largest: it grows to the most rows
    and the most positions any of `calls` asks for. A call runs at bucket(rows in flight,
    rollout.batch_size) rows and a multiple of data.max_prompt_tokens + rollout.max_new_tokens positions."""
    r, block = cfg.rollout, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    rows = max(bucket(rows_in_flight(c, r.batch_size), r.batch_size) for c in calls)
    length = max(block * -(-c.longest // block) for c in calls)
    return rows, length


Row = tuple[str, str, int, str]       # (key, description, bytes on the GPU, phase: both | generation | update)


def trainer_tensors(rows: list[Row]) -> int:
    """The trainer's PyTorch tensors in the larger phase: every row but vLLM's share, the allocator's cache, the
    constant and the rows of engine processes (each has its own allocator)."""
    return max(sum(b for key, _, b, ph in rows if key not in ("vllm", "allocator", "overhead")
                   and not key.startswith(ENGINE) and ph in ("both", phase))
               for phase in ("generation", "update"))


@dataclass
class Plan:
    """The plan of one GPU: the trainer's (with the engine processes that share it), or, in `others`, a GPU that
    holds engine processes only (rollout.mode=async with rollout.engine_gpus)."""
    gpus: int                               # the trainer's GPUs (ranks)
    gpu_bytes: int
    rows: list[Row]
    notes: list[str]
    blocker: str = ""                       # a reason it cannot start whatever the sum says
    checkpointing: str = "none"             # the mode planned (model.gradient_checkpointing, auto resolved)
    auto: bool = False                      # chosen by model.gradient_checkpointing=auto
    where: str = ""                         # rollout.mode=async: what this GPU holds ("GPU 0: trainer rank 0 + ...")
    others: list[Plan] = dataclasses.field(default_factory=list)   # the run's GPUs that hold engine processes only

    def phase_bytes(self, phase: str) -> int:
        return sum(b for _, _, b, ph in self.rows if ph in ("both", phase))

    @property
    def tensors(self) -> int:
        """The trainer's tensors in the larger phase (`trainer_tensors`): what torch.cuda.max_memory_allocated
        should reach on a transformers-engine run."""
        return trainer_tensors(self.rows)

    @property
    def peak(self) -> int:
        return max(self.phase_bytes("generation"), self.phase_bytes("update"))

    @property
    def fits_here(self) -> bool:
        """This GPU fits (the others aside)."""
        return self.peak <= self.gpu_bytes and not self.blocker

    @property
    def fits(self) -> bool:
        """Every GPU of the run fits."""
        return self.fits_here and all(p.fits for p in self.others)

    def verdict(self) -> str:
        phase = "update" if self.phase_bytes("update") >= self.phase_bytes("generation") else "generation"
        margin = abs(self.gpu_bytes - self.peak) / GiB
        head = f"peak {self.peak / GiB:.1f} GiB ({phase}) of {self.gpu_bytes / GiB:.1f} GiB: "
        if self.blocker:
            return head + f"does not fit, {self.blocker}"
        if self.fits_here:
            return head + f"fits, {margin:.1f} GiB to spare"
        return head + f"does not fit, {margin:.1f} GiB over"


LORA_SHAPES = {   # the linear layers of a Qwen2 / Llama-style decoder layer: name -> (in, out) from an Arch
    "q_proj": lambda a: (a.hidden, a.heads * a.head_dim), "k_proj": lambda a: (a.hidden, a.kv_heads * a.head_dim),
    "v_proj": lambda a: (a.hidden, a.kv_heads * a.head_dim), "o_proj": lambda a: (a.heads * a.head_dim, a.hidden),
    "gate_proj": lambda a: (a.hidden, a.intermediate), "up_proj": lambda a: (a.hidden, a.intermediate),
    "down_proj": lambda a: (a.intermediate, a.hidden)}


def lora_params(a: Arch, lora: LoraConfig) -> int:
    """LoRA's trainable parameters: rank x (in + out) per targeted linear layer, in every decoder layer
    ("all-linear": the seven of a Qwen2 / Llama layer; a name the plan does not know counts as the
    largest of them, an upper bound)."""
    rank, names = lora.rank, list(LORA_SHAPES) if lora.targets == "all-linear" else lora.targets
    largest = max(sum(f(a)) for f in LORA_SHAPES.values())
    return a.layers * rank * sum(sum(LORA_SHAPES[n](a)) if n in LORA_SHAPES else largest for n in names)


def micro_batch_shape(cfg: Config, update_rows: int) -> tuple[int, int, bool]:
    """(positions, completion positions, whether it is the step's only micro-batch) of the largest
    micro-batch a step trains (micro_batches.py), upper bounds from the settings alone. S = P_max + T:
    - a token budget B, packed or not: max(B, S) positions (a packed row holds at most B tokens, a
      sequence longer than B goes alone; unpacked, rows x the longest row stays within B unless one row
      is longer), at most the step's rows x S;
    - fixed micro-batches of m rows: m x S;
    the head scores at most every position, and at most T per row."""
    t, S, T = cfg.train, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens
    if t.micro_batch_tokens:
        tokens = min(max(t.micro_batch_tokens, S), update_rows * S)
        return tokens, min(tokens, update_rows * T), t.micro_batch_tokens >= update_rows * S
    rows = min(t.micro_batch_size, update_rows)
    return rows * S, rows * T, rows == update_rows


def make_plan(cfg: Config, a: Arch, *, gpus: int, gpu_bytes: int, engine: str,
              prm: PRMArch | None = None) -> Plan:
    """The per-GPU plan of cfg on `gpus` GPUs of `gpu_bytes`; engine: "vllm" or "hf" (resolved); prm: the
    process reward model's shape when reward.prm != 0. model.gradient_checkpointing auto: the plan of
    the first of none, selective, full (in order of recompute) that fits GPU 0 (trainer rank 0, the one that
    holds the most), else full's; Plan.checkpointing names the mode planned. rollout.mode=async: the engine
    processes run `engine`, placed by rollout.engine_gpus (`engine_placement`)."""
    mode = cfg.model.gradient_checkpointing
    if mode != "auto":
        return _make_plan(cfg, a, mode, gpus=gpus, gpu_bytes=gpu_bytes, engine=engine, prm=prm)
    plans = [_make_plan(cfg, a, m, gpus=gpus, gpu_bytes=gpu_bytes, engine=engine, prm=prm)
             for m in CHECKPOINTING if m != "auto"]
    chosen = next((p for p in plans if p.fits_here), plans[-1])
    peaks = ", ".join(f"{p.checkpointing} {p.peak / GiB:.1f}" for p in plans)
    chosen.notes.append(f"model.gradient_checkpointing auto -> {chosen.checkpointing}: the first of none, "
                        f"selective, full (in order of recompute) that fits; peak GiB {peaks}")
    chosen.auto = True
    return chosen


def _make_plan(cfg: Config, a: Arch, mode: str, *, gpus: int, gpu_bytes: int, engine: str,
               prm: PRMArch | None) -> Plan:
    """make_plan with the checkpointing mode given (none, selective or full): the plan of GPU 0 (trainer rank
    0, and the engine processes placed there), the run's other GPUs that hold engines in `others`."""
    N, placed = gpus, engine_placement(cfg)
    args = dict(gpus=N, gpu_bytes=gpu_bytes, engine=engine, prm=prm)
    main = trainer_plan(cfg, a, mode, gpu=0, engines=placed.get(0, 0), **args)
    if cfg.rollout.mode == "async" and N > 1:
        main.where += "; GPU 1: trainer rank 1" if N == 2 else f"; GPUs 1-{N - 1}: trainer ranks 1-{N - 1}"
    main.others = [trainer_plan(cfg, a, mode, gpu=g, engines=k, **args) if g < N else
                   engine_plan(cfg, a, gpus=N, gpu_bytes=gpu_bytes, kind=engine, gpu=g, engines=k)
                   for g, k in sorted(placed.items()) if g != 0]
    return main


def engine_placement(cfg: Config) -> dict[int, int]:
    """rollout.mode=async: {GPU: the engine processes on it}: one each on rollout.engine_gpus, or all on GPU 0
    when it is empty (an engine inherits the trainer's visible devices and takes the first: rank 0's GPU); {} in
    sync mode. GPUs 0..N-1 hold the trainer's ranks."""
    r = cfg.rollout
    if r.mode != "async":
        return {}
    placed: dict[int, int] = {}
    for g in (parse_ints(r.engine_gpus) if r.engine_gpus else [0] * r.engines):
        placed[g] = placed.get(g, 0) + 1
    return placed


def engines_text(k: int, kind: str) -> str:
    return f"{k} {kind} engine{'s' if k > 1 else ''}"


def trainer_plan(cfg: Config, a: Arch, mode: str, *, gpus: int, gpu_bytes: int, engine: str, prm: PRMArch | None,
                 gpu: int = 0, engines: int = 0) -> Plan:
    """A trainer rank's GPU: the training state, the update's peak, the in-process engine (sync) or, in async
    mode, the evaluation engine and the staging of the weights, the PRM, and `engines` engine processes placed
    on it (async)."""
    m, r, N = cfg.model, cfg.rollout, gpus
    shape = step_shape(cfg, cfg.train.prompts_per_step // N)
    tokens, completion, only = micro_batch_shape(cfg, shape.update_rows)
    P, L = a.params, a.layer_params
    notes: list[str] = []
    lora = m.lora.rank > 0
    if lora:                                 # a frozen base (bf16 under model.bf16), float32 adapters
        A, base = lora_params(a, m.lora), 2 if m.bf16 else 4
        rows = [("params", f"frozen base ({'bf16' if m.bf16 else 'fp32'}, 1/{N}), no gradient or AdamW state",
                 base * P // N, "both"),
                ("adapters", f"LoRA adapters, {A / 1e6:.1f}M: fp32 weights, gradients, AdamW m, v (1/{N})",
                 16 * A // N, "both")]
    else:
        rows = [("params", f"parameters (fp32, 1/{N})", 4 * P // N, "both"),
                ("grads", f"gradients (fp32, 1/{N})", 4 * P // N, "update"),
                ("adam", f"AdamW m, v (2 x fp32, 1/{N})", 8 * P // N, "both")]
    if cfg.algo.needs_reference and lora:
        notes.append("reference model: the base with the adapters switched off (no copy)")
    elif cfg.algo.needs_reference:
        rows.append(("ref", f"reference model (fp32, 1/{N}; algo.beta > 0 or REINFORCE++ kl_coef > 0)",
                     4 * P // N, "both"))
    if N > 1:
        rows.append(("fsdp", "FSDP2 unsharded: root params + grad, 2 layers + 1 grad",
                     4 * (2 * a.root_params + 3 * L), "update"))
    # the largest micro-batch at its peak moment, gradients included (the grads row holds them); counted
    # as the step's second micro-batch (gradients alive from its start) unless it is the only one
    grads = 0 if lora else 4 * P // N
    shape_args = dict(tokens=tokens, completion=completion, bf16=m.bf16, chunk_tokens=m.logprob_chunk_tokens,
                      grads=grads, first=only, lora=lora, gpus=N)
    peak, moment = micro_batch_peak(a, checkpointing=mode, **shape_args)
    rows.append(("acts", f"activations: {tokens} positions, checkpointing {mode}, at the {moment}",
                 peak - grads, "update"))
    rows.append(("margin", "cuBLAS workspaces and small tensors the plan does not list", UPDATE_MARGIN,
                 "update"))
    blocker = ""
    if r.mode == "async":                    # engine processes generate; the trainer evaluates and stages
        calls = eval_calls(cfg)
        if calls:                            # the evaluation engine (rollout.py), built at the first evaluation
            rows += policy_engine_rows(cfg, a, calls, gpus=N, key="eval_", what="eval: ")
        rows += staging_rows(cfg, a, gpus=N, kind=engine)
    elif engine == "vllm":
        share, weights, kv, held = vllm_share(cfg, a, gpu_bytes)
        rows.append(("vllm", f"vLLM {r.gpu_memory_utilization:g} x GPU: weights {weights / GiB:.2f} + KV "
                     f"{kv / GiB:.2f}, {'asleep' if r.sleep else 'awake'} in update", share,
                     "generation" if r.sleep else "both"))
        calls, seq = shape.calls, cfg.data.max_prompt_tokens + r.max_new_tokens
        largest = max(c.sequences for c in calls)                          # submitted in one call
        notes.append(f"vLLM KV cache: {kv_bytes_per_token(a, 2 if m.bf16 else 4)} B/token, holds {held} sequences "
                     f"of {seq} tokens; a step generates {sum(c.sequences for c in calls)} per GPU, up to "
                     f"{largest} in one call" + ("" if held >= largest else " (in waves)"))
        if held < 1:
            blocker = "vLLM's share cannot hold one full-length sequence (rollout.gpu_memory_utilization)"
    else:                                    # the transformers engine on the policy itself (rollout.py)
        rows += policy_engine_rows(cfg, a, shape.calls + eval_calls(cfg), gpus=N)
    if prm is not None:                      # PSPO*'s PRM: bf16 on every GPU, one forward at a time
        rows.append(("prm", f"process reward model ({prm.params / 1e6:.1f}M, bf16, whole on each GPU)",
                     2 * prm.params, "both"))
        rows.append(("prm_acts", f"PRM forward, {cfg.prm.batch_tokens} tokens", cfg.prm.batch_tokens * 2 *
                     (6 * prm.hidden + 2 * prm.intermediate), "generation"))
    tensors = trainer_tensors(rows)          # what PyTorch's allocator hands out
    slack = f"allocator cache: {ALLOCATOR_SLACK:g} x {tensors / GiB:.1f} GiB of tensors (larger phase)"
    rows.append(("allocator", slack, int(ALLOCATOR_SLACK * tensors), "both"))
    rows.append(("overhead", "CUDA context, NCCL, cuBLAS (constant)", int(OVERHEAD_GIB * GiB), "both"))
    where = ""
    if r.mode == "async":
        where = f"GPU {gpu}: trainer rank {gpu}" + (f" + {engines_text(engines, engine)}" if engines else "")
    if engines:
        more, engine_notes, engine_blocker = engine_rows(cfg, a, kind=engine, engines=engines, gpu_bytes=gpu_bytes)
        rows, notes, blocker = rows + more, notes + engine_notes, blocker or engine_blocker
    return Plan(N, gpu_bytes, rows, notes, blocker, checkpointing=mode, where=where)


def engine_plan(cfg: Config, a: Arch, *, gpus: int, gpu_bytes: int, kind: str, gpu: int, engines: int) -> Plan:
    """A GPU that holds engine processes only (rollout.engine_gpus)."""
    rows, notes, blocker = engine_rows(cfg, a, kind=kind, engines=engines, gpu_bytes=gpu_bytes)
    return Plan(gpus, gpu_bytes, rows, notes, blocker, where=f"GPU {gpu}: {engines_text(engines, kind)}")


def vllm_share(cfg: Config, a: Arch, gpu_bytes: int) -> tuple[int, int, int, int]:
    """(vLLM's share of the GPU, its weights, its KV cache in bytes, the full-length sequences the cache holds):
    rollout.gpu_memory_utilization x the GPU, the weights in bf16 under model.bf16 (else float32), the KV cache
    in the rest (vLLM's own profiled activations not counted)."""
    dtype, seq = 2 if cfg.model.bf16 else 4, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    share, weights = int(cfg.rollout.gpu_memory_utilization * gpu_bytes), a.params * dtype
    kv = share - weights
    return share, weights, kv, max(kv, 0) // (kv_bytes_per_token(a, dtype) * seq)


def policy_engine_rows(cfg: Config, a: Arch, calls: list[GenerateCall], *, gpus: int, key: str = "",
                       what: str = "", phase: str = "generation") -> list[Row]:
    """The transformers engine on the policy (rollout.py: HFEngine) for `calls`. One GPU: decode.py's static-cache
    loop, its KV cache and its twin's bf16 copies kept from its first call on, and its working set (`decode_bytes`)
    while it generates (`phase`). Over N > 1 GPUs, transformers `generate` on the sharded policy, during
    generation: the KV cache of the rows in flight at their longest (fp32 K after RoPE, 6 or 8 B a value),
    its working set, autocast's bf16 weight copies and the gathered FSDP2 parameters; the largest call counts.
    key: the rows' key prefix; what: their descriptions'."""
    m, r, lora = cfg.model, cfg.rollout, cfg.model.lora.rank > 0
    if gpus > 1:
        per_token = a.layers * a.kv_heads * a.head_dim * (6 if m.bf16 else 8)
        cost, batch, longest = max((n * c.longest * per_token + decode_bytes(a, n, c.width, c.longest - c.width,
                                                                               m.bf16, lora), n, c.longest)
                                   for c, n in ((c, rows_in_flight(c, r.batch_size)) for c in calls))
        work = (2 * a.params if m.bf16 else 0) + 4 * (a.root_params + 2 * a.layer_params)
        return [(f"{key}generate", f"{what}generate: KV of {batch} x {longest} tokens, bf16 weight copies, "
                 "decoding, gathered params", cost + work, "generation")]
    cache_rows, length = static_cache_shape(cfg, calls)
    rows = [(f"{key}kvcache", f"{what}static KV cache, {cache_rows} x {length} positions ({2 if m.bf16 else 4} B), "
             "kept", static_cache_bytes(a, cache_rows, length, m.bf16), "both")]
    if m.bf16 and lora:                      # the base is bf16 already: the decoder shares it
        rows.append((f"{key}copies", f"{what}the decoder's bf16 copies of the adapters, kept",
                     2 * lora_params(a, m.lora), "both"))
    elif m.bf16:
        rows.append((f"{key}copies", f"{what}the decoder's bf16 copies of the linear layers, kept",
                     2 * a.linear_params, "both"))
    work, batch, width = max((decode_bytes(a, n, c.width, c.longest - c.width, m.bf16, lora), n, c.width)
                             for c, n in ((c, bucket(rows_in_flight(c, r.batch_size), r.batch_size)) for c in calls))
    rows.append((f"{key}generate", f"{what}decoding: prefill {batch} x {width} tokens / sampler {batch} rows x vocab",
                 work, phase))
    return rows


def staging_rows(cfg: Config, a: Arch, *, gpus: int, kind: str) -> list[Row]:
    """rollout.mode=async: a launch stages the weights in host memory (engines/staging.py: stage) one tensor at a
    time, the largest counting (the embedding or an MLP projection; under LoRA, an adapter): over N > 1 GPUs
    each is gathered whole (fp32); with the sync check (rollout.sync_check_steps > 0) rank 0 takes its row sums,
    a copy in the staged dtype where it differs (bf16, for vLLM under model.bf16), an int64 block of at most
    2^24 elements and its sums (one int64 a row, at most max(vocab, I) rows). On one GPU without the check,
    nothing."""
    m, lora = cfg.model, cfg.model.lora.rank > 0
    largest = m.lora.rank * max(a.hidden, a.intermediate, a.heads * a.head_dim) if lora else a.largest_param
    check = cfg.rollout.sync_check_steps > 0
    cast = 2 * largest if check and kind == "vllm" and m.bf16 and not lora else 0
    sums = 8 * (min(largest, 2**24) + max(a.vocab, a.intermediate)) if check else 0
    staged = (4 * largest if gpus > 1 else 0) + cast + sums
    if not staged:
        return []
    return [("staging", f"staging the weights: {'a gathered tensor, ' if gpus > 1 else ''}"
             f"{'its row sums' if check else ''}".rstrip(", "), staged, "generation")]


def engine_rows(cfg: Config, a: Arch, *, kind: str, engines: int, gpu_bytes: int) -> tuple[list[Row], list[str], str]:
    """(rows, notes, blocker) of `engines` engine processes on one GPU (rollout.mode=async: engines/process.py), all
    in both phases: they generate while the trainer updates. Each generates its slice of the step (`engine_call`).
    - vllm: rollout.gpu_memory_utilization x the GPU each (`vllm_share`), awake (async refuses rollout.sleep);
    - hf: its own copy of the model (fp32, or under LoRA the base, bf16 under model.bf16, and fp32 adapters), the
      static-cache loop's KV cache, bf16 copies and working set (`policy_engine_rows`), its allocator's cache
      (ALLOCATOR_SLACK x its tensors) and its CUDA context (ENGINE_OVERHEAD_GIB)."""
    m, r, k = cfg.model, cfg.rollout, engines
    call = engine_call(cfg)
    what = f"{k} x engine: " if k > 1 else "engine: "
    if kind == "vllm":
        share, weights, kv, held = vllm_share(cfg, a, gpu_bytes)
        rows = [(f"{ENGINE}_vllm", f"{what}vLLM {r.gpu_memory_utilization:g} x GPU: weights {weights / GiB:.2f} + KV "
                 f"{kv / GiB:.2f}, awake", k * share, "both")]
        note = (f"engine vLLM KV cache: holds {held} sequences of {call.longest} tokens; an engine generates up to "
                f"{call.sequences} a step" + ("" if held >= call.sequences else " (in waves)"))
        blocker = "" if held >= 1 else \
            "an engine's vLLM share cannot hold one full-length sequence (rollout.gpu_memory_utilization)"
        return rows, [note], blocker
    lora = m.lora.rank > 0
    model = ((2 if m.bf16 else 4) * a.params + 4 * lora_params(a, m.lora)) if lora else 4 * a.params
    base = f"the base in {'bf16' if m.bf16 else 'fp32'}, fp32 adapters" if lora else "fp32"
    rows = [(f"{ENGINE}_model", f"{what}its copy of the model ({base})", model, "both")]
    rows += policy_engine_rows(cfg, a, [call], gpus=1, key=f"{ENGINE}_", what=what, phase="both")
    rows = [(key, text, k * b, phase) for key, text, b, phase in rows]
    tensors = sum(b for _, _, b, _ in rows)
    rows += [(f"{ENGINE}_allocator", f"{what}allocator cache, {ALLOCATOR_SLACK:g} x {tensors / GiB:.2f} GiB of tensors",
              int(ALLOCATOR_SLACK * tensors), "both"),
             (f"{ENGINE}_overhead", f"{what}CUDA context, cuBLAS ({ENGINE_OVERHEAD_GIB:g} GiB)",
              int(k * ENGINE_OVERHEAD_GIB * GiB), "both")]
    return rows, [], ""


BUDGET_STEP = 1024          # largest_token_budget tries budgets in steps of this many tokens


def largest_token_budget(cfg: Config, a: Arch, *, gpus: int, gpu_bytes: int, engine: str,
                         prm: PRMArch | None = None) -> int:
    """The largest train.micro_batch_tokens whose plan fits: one full-length sequence (P_max + T), then
    multiples of BUDGET_STEP tokens, up to the tokens one GPU trains in a step; 0 when not even one
    sequence fits. With model.gradient_checkpointing auto, at the mode auto picks for one sequence (the
    least recompute that fits): a larger budget that fits only with more recompute is not offered. The
    GPU recipes set their budget to this on one 80 GB GPU (tests/components/test_plan.py), and `--plan`
    prints it for the GPUs asked about."""
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    most = step_shape(cfg, cfg.train.prompts_per_step // gpus).update_rows * seq

    def plan_at(budget: int, mode: str) -> Plan:
        model = dataclasses.replace(cfg.model, gradient_checkpointing=mode)
        trial = dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, micro_batch_tokens=budget))
        return make_plan(trial, a, gpus=gpus, gpu_bytes=gpu_bytes, engine=engine, prm=prm)
    first = plan_at(seq, cfg.model.gradient_checkpointing)
    if not first.fits_here:
        return 0
    best = seq
    for budget in range(-(-seq // BUDGET_STEP) * BUDGET_STEP, most + BUDGET_STEP, BUDGET_STEP):
        budget = min(budget, most)
        if budget <= best:
            continue
        if not plan_at(budget, first.checkpointing).fits_here:
            break
        best = budget
    return best


def format_plan(plan: Plan, title: str) -> str:
    """The table `--plan` prints: GPU 0's, then each other GPU the run places engines on."""
    lines = [title]
    for p in (plan, *plan.others):
        lines += ([p.where] if p.where else []) + [f"{'component':<76} {'GiB':>6}  phase"]
        lines += [f"{text:<76} {b / GiB:6.2f}  {phase}" for _, text, b, phase in p.rows]
        lines += [f"{'total: ' + phase:<76} {p.phase_bytes(phase) / GiB:6.2f}" for phase in ("generation", "update")]
        lines += p.notes + ["verdict: " + p.verdict()]
    return "\n".join(lines)


def one_line(plan: Plan) -> str:
    """The start-up line: every component, the checkpointing mode planned, then the verdict; and every other GPU
    the run places engines on, its components and verdict."""
    def parts(p: Plan) -> str:
        return " + ".join(f"{key} {b / GiB:.1f}" for key, _, b, _ in p.rows)
    mode = f"{'auto -> ' if plan.auto else ''}{plan.checkpointing}"
    where = f"; {plan.where}" if plan.where else ""
    line = (f"memory plan per GPU ({plan.gpus} x {plan.gpu_bytes / GiB:.1f} GiB, checkpointing {mode}{where}): "
            f"{parts(plan)} GiB; tensors {plan.tensors / GiB:.1f} GiB; {plan.verdict()}")
    return line + "".join(f"; {p.where}: {parts(p)} GiB; {p.verdict()}" for p in plan.others)


def check_fits(plan: Plan, cfg: Config) -> None:
    """Raise PlanError (one line, with what to change) when the run cannot fit: on GPU 0 or on any other GPU it
    places engine processes on."""
    if plan.fits:
        return
    over = [p for p in (plan, *plan.others) if not p.fits_here]
    keys = {key for p in over for key, *_ in p.rows}
    t, r = cfg.train, cfg.rollout
    trainer = "params" in keys
    shared = any(key.startswith(ENGINE) for key in keys) and (trainer or r.engines > 1 and not r.engine_gpus)
    knobs = ["a smaller train.micro_batch_tokens" if trainer and t.micro_batch_tokens else
             "a smaller train.micro_batch_size" if trainer and t.micro_batch_size > 1 else "",
             "model.gradient_checkpointing=auto" if trainer and plan.checkpointing != "full" else "",
             "rollout.sleep=true" if "vllm" in keys and not r.sleep else "",
             "a smaller eval.batch_size" if "eval_kvcache" in keys or "eval_generate" in keys else "",
             "a GPU for each engine (rollout.engine_gpus)" if shared else "",
             "a smaller rollout.gpu_memory_utilization" if f"{ENGINE}_vllm" in keys else "",
             "a smaller rollout.batch_size" if f"{ENGINE}_kvcache" in keys else "",
             "more GPUs" if trainer else ""]
    raise PlanError(f"{one_line(plan)}. Try {', '.join(k for k in knobs if k)} "
                    "(train.py --config ... --plan); train.memory_check=false starts anyway")


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def startup_check(cfg: Config, model_path: str, world_size: int, device: torch.device, engine: str, *,
                  resolve: Resolve) -> tuple[str, str]:
    """train.py's start-up: (the plan in one line, the checkpointing mode to build the policy with);
    on CUDA, PlanError when it cannot fit. engine: the resolved rollout.engine ("vllm" or "hf",
    rollout.engine_name): the in-process engine's, or with rollout.mode=async the engine processes'; resolve:
    as for `plan_cli`. Every GPU is taken to be the size of `device`'s.

    model.gradient_checkpointing auto is resolved here: on CUDA, the mode the plan picks (the least
    recompute that fits the GPU); on CPU, none: there is no GPU memory to fit, and the plan is printed
    against the host's memory for information only (it models GPU kernels and vLLM's GPU share, and
    host memory is shared with everything else, and swap); full when the plan cannot be made.
    """
    asked, on_gpu = cfg.model.gradient_checkpointing, device.type == "cuda"
    mode = "none" if asked == "auto" and not on_gpu else asked
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=mode))
    try:
        model_config = load_model_config(model_path, cfg.model.trust_remote_code)
        a = arch_from_config(model_config, cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - an architecture the plan cannot read: train anyway, say why
        mode = "full" if mode == "auto" else mode
        return f"memory plan: unavailable ({error_line(e, 200)}); checkpointing {mode}", mode
    total = torch.cuda.get_device_properties(device).total_memory if on_gpu else host_memory()
    plan = make_plan(cfg, a, gpus=world_size, gpu_bytes=total, engine=engine,
                     prm=load_prm_arch(cfg, local_only=False, resolve=resolve)[0])
    if on_gpu and cfg.train.memory_check:
        check_fits(plan, cfg)
        return one_line(plan), plan.checkpointing
    if on_gpu:
        return one_line(plan) + " (train.memory_check=false: not enforced)", plan.checkpointing
    auto = "; checkpointing auto -> none on CPU: no GPU memory to fit" if asked != mode else ""
    return one_line(plan) + f" (CPU run: not enforced{auto})", plan.checkpointing


def plan_cli(argv: list[str], *, resolve: Resolve) -> str:
    """`train.py --config X --plan [--gpus=N] [--gpu_gib=G] [overrides]` -> the table. resolve: a model
    name -> its folder, building a built-in model once (offline/builtin.py's resolve_model_path, handed
    in: the offline builders stand above this folder); anything else as given."""
    gpus, gpu_gib, rest = DEFAULT_GPUS, DEFAULT_GPU_GIB, []
    joined: list[str] = []                          # "--gpus 4" -> "--gpus=4"
    for arg in argv:
        if joined and joined[-1] in ("--gpus", "--gpu_gib") and not arg.startswith("--"):
            joined[-1] += f"={arg}"
        else:
            joined.append(arg)
    for arg in joined:
        key, _, value = arg.partition("=")
        try:
            if key == "--gpus":
                gpus = int(value)
            elif key == "--gpu_gib":
                gpu_gib = float(value)
            elif arg != "--plan":
                rest.append(arg)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}; {USAGE}") from None
    if len(rest) < 2 or rest[0] != "--config" or gpus < 1 or not gpu_gib > 0:
        raise ConfigError(USAGE)
    cfg = load_config(rest[1], rest[2:], gpus)
    a, source = load_arch(resolve(cfg.model.name_or_path), rest[1], cfg.model.trust_remote_code)
    engine = "vllm" if cfg.rollout.engine == "auto" else cfg.rollout.engine          # auto on a GPU
    prm, missing = load_prm_arch(cfg, local_only=True, resolve=resolve)
    plan = make_plan(cfg, a, gpus=gpus, gpu_bytes=int(gpu_gib * GiB), engine=engine, prm=prm)
    plan.notes += [missing] if missing else []
    r = cfg.rollout
    on = f"GPU{'s' if ',' in r.engine_gpus else ''} {r.engine_gpus}" if r.engine_gpus else "GPU 0"
    engines = f"; rollout.mode=async: {engines_text(r.engines, engine)} on {on}" if r.mode == "async" else ""
    title = (f"Memory plan per GPU: {rest[1]} on {gpus} GPUs x {gpu_gib:g} GiB, engine {engine}{engines}\n"
             f"architecture: {source}: {a.params / 1e9:.3f}B parameters, {a.layers} layers, "
             f"hidden {a.hidden}, MLP {a.intermediate}, {a.heads} heads / {a.kv_heads} KV heads x "
             f"{a.head_dim}, vocab {a.vocab}\n"
             f"bf16 autocast {'on' if cfg.model.bf16 else 'off'}; checkpointing {cfg.model.gradient_checkpointing}; "
             f"attention: flash / varlen (no s x s matrix); allocator cache {ALLOCATOR_SLACK:g} x tensors; "
             f"overhead constant {OVERHEAD_GIB:g} GiB")
    budget = largest_token_budget(cfg, a, gpus=gpus, gpu_bytes=int(gpu_gib * GiB), engine=engine, prm=prm)
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    this_run = cfg.train.micro_batch_tokens or f"fixed {cfg.train.micro_batch_size}"
    if budget:
        at = make_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_tokens=budget)),
                       a, gpus=gpus, gpu_bytes=int(gpu_gib * GiB), engine=engine, prm=prm)
        advice = (f"largest token budget that fits: train.micro_batch_tokens={budget} ({budget / seq:.2g} "
                  f"sequences of {seq} tokens, checkpointing {at.checkpointing}; this run: {this_run})")
    else:
        advice = "no token budget fits: not even one full-length sequence"
    return format_plan(plan, title) + "\n" + advice
