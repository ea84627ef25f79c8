"""Static-cache decoding: the transformers engine's own loop over the model (rollout.HFEngine).

One prefill over the left-padded prompts fills a preallocated KV cache (`StaticKV`); then each
step feeds every row's last token, one position further, and draws the next one with the
counter-based sampler (sampling.py, docs/methods.md §1). A row is done at its stop token or at its
own budget of new tokens; the loop ends when every row is done. Its tokens, log-probs and width
are those of `generate` with hf_engine.py's logits processor.

A step reads what it must, in a few fixed shapes:
- **Length-aware window.** The step that writes cache column c attends over columns [0, W) only,
  W = `window(c + 1, length)`: the next power of two, capped at the cache length (a 4096-position
  cache meets W = 256, 512, 1024, 2048, 4096 for a 200-token prompt). A step reads at most twice
  the filled columns, and a call meets about log2(length / prompt) windows.
- **Row compaction.** At each done check (every step on CPU; once per DONE_CHECK_STEPS on CUDA,
  where a check waits for the GPU), when the rows still running fit a smaller row bucket
  (tokens.py:bucket, down to MIN_ROWS), they are gathered into it: cache rows, last tokens,
  positions, key mask, seeds, done flags, budgets. The tail of the longest completions then runs
  on a few rows. Each row's tokens are written back at its original index.
Neither changes a token: the Gumbel draw of a row depends on its seed and the position alone,
a masked cache column weighs exactly 0, and a row's numbers do not depend on the other rows but
for float rounding (`Decoder(window=False, compact=False)` keeps the whole cache and every row to
the end, and the tests compare the two).

With `compile`, the step is `torch.compile`d (mode "reduce-overhead" on CUDA: replayed as CUDA
graphs). The write position and the sampler's position are 0-dim tensors, and the rows and the
window are dynamic dimensions: one compile serves every (rows, window) shape of a cache length,
and CUDA graphs record one graph per shape met (a few windows per row bucket) from then on.
Compaction stops at 2 rows and the cache holds a spare column (SPARE) because a size of 1, or a
window as wide as the whole cache view, would each compile the step once more. A step or sampler whose compile
fails runs eagerly from then on: the same tokens, more kernel launches (compiled.py's rule; a step repeated
eagerly writes the same cache column again).

The model run is `policy.lm`'s twin (`decode_twin`): the same modules sharing its parameters,
except that under bf16 autocast (model.bf16) its linear layers hold bf16 copies, refreshed from
the policy before each call. Autocast would cast those weights at every step (6 bytes moved per
parameter before the matmul reads 2); the copies give the same bf16 values once per call. The twin's
attention (`static_attention`) is sdpa over the prompt in the prefill and, per step, a grouped
matmul over the window that reads each KV head once (sdpa with a padding mask would repeat the KV
heads for every query head).
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pspo.engines.sampling import column_keys, draw
from pspo.training.compiled import Compiled
from pspo.training.tokens import bucket

STATIC_ATTENTION = "pspo_static"      # the twin's config._attn_implementation
DONE_CHECK_STEPS = 16                 # on CUDA, look whether every row is done once per this many steps
SPARE = 1                             # columns the cache and the key mask hold past the cache length
MIN_ROWS = 2                          # compaction's smallest bucket: torch.compile specializes a size of 1
COMPILE_OFF = "rollout.compile=never"  # the setting a failed compile's warning names (compiled.py)


def static_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[Tensor, None]:
    """Attention over a StaticKV's first W columns, W = the mask's width. query (R, H, q, D); key,
    value (R, Hkv, L, D), the whole cache; attention_mask (R, 1, q, W) bool, True = attend, W <= L.
    Returns (R, q, H, D).

    The prefill (q > 1) is sdpa over the prompt's W columns. A step (q = 1) groups the H query heads
    by KV head: scores (R, Hkv, H/Hkv, W) = q K^T, a masked softmax in float32, then probs V: each KV
    head is read once, and only the window's columns.
    """
    width = attention_mask.shape[-1]
    key, value = key[:, :, :width], value[:, :, :width]                         # (R, Hkv, W, D)
    if query.shape[2] > 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)              # (R, Hkv, G, D)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling             # (R, Hkv, G, W)
    scores = scores.float().masked_fill(~attention_mask, float("-inf"))         # mask (R, 1, 1, W)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)                                            # (R, Hkv, G, D)
    return out.reshape(rows, 1, heads, dim), None


AttentionInterface.register(STATIC_ATTENTION, static_attention)


class StaticKV:
    """Preallocated keys and values, (R, Hkv, L + SPARE, D) per layer: views of one buffer that the decoder
    keeps at the largest (rows, length) asked so far. `update` (transformers' cache interface: the name
    each attention layer calls) writes at column `start`, a 0-dim tensor set before each forward, and
    returns the whole cache (static_attention reads the mask's width of it)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor]):
        self.keys, self.values = keys, values
        self.start = torch.zeros((), dtype=torch.int64, device=keys[0].device)
        for t in keys + values + [self.start]:
            torch._dynamo.mark_static_address(t)       # CUDA graphs read them in place, no copy per step

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        columns = self.start + torch.arange(key.shape[2], device=key.device)
        # the cache's dtype: under autocast, K leaves RoPE in float32 and sdpa would cast it to bf16 anyway
        self.keys[layer_idx].index_copy_(2, columns, key.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, columns, value.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


def decode_twin(lm: torch.nn.Module, bf16: bool) -> tuple[torch.nn.Module, list[tuple[Tensor, Tensor]]]:
    """(twin, [(copy, source)]): lm's modules sharing its parameters, with STATIC_ATTENTION; with
    bf16, every float32 nn.Linear's weight and bias replaced by a bf16 copy (a tied head gets its own,
    the embedding stays shared in float32), as autocast would cast them; weights already in bf16 (a
    frozen LoRA base) stay shared."""
    twin = copy.deepcopy(lm, {id(p): p for p in lm.parameters()})     # buffers and config copied
    twin.config._attn_implementation = STATIC_ATTENTION
    twin.eval()
    pairs = []
    if bf16:
        for mine, source in zip(twin.modules(), lm.modules()):
            if not isinstance(mine, torch.nn.Linear):
                continue
            for name in ("weight", "bias"):
                p = getattr(source, name)
                if p is None or p.dtype == torch.bfloat16:        # a bf16 LoRA base: shared, not copied
                    continue
                setattr(mine, name, torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
                pairs.append((getattr(mine, name), p))
    return twin, pairs


def window(columns: int, length: int) -> int:
    """The cache columns a step attends over when `columns` of them are filled (its own included):
    the next power of two, capped at the cache length. window(201, 4096) = 256, window(257, 4096) =
    512, window(3000, 4096) = 4096, window(40, 50) = 50: at most 2x the filled columns, and
    log2(length / prompt) + 1 shapes in a call."""
    return min(length, 1 << (columns - 1).bit_length())


class Decoder:
    """The static-cache loop on one policy: its twin, the cache buffer and the step functions.

    max_rows: the top row bucket (the engine's rows per call); max_len: the cache-length block
    (longest prompt + max_new_tokens; 0 = each call's own length). With pad_shapes (default: when
    compiled), rows are padded to `bucket(rows, max_rows)` and the cache to a multiple of max_len.
    window: a step attends over `window(...)` columns, else over the whole cache; compact: rows that
    are done leave at the done checks, else every row runs to the end (module docstring).
    """

    def __init__(self, policy: torch.nn.Module, stop_ids: list[int], pad_id: int, max_rows: int,
                 max_len: int = 0, compile: bool = False, window: bool = True, compact: bool = True):
        self.lm, self.bf16 = policy.lm, bool(getattr(policy, "bf16", False))
        self.twin, self.pairs = decode_twin(self.lm, self.bf16)
        self.device = next(self.lm.parameters()).device
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.pad_id, self.max_rows, self.max_len = pad_id, max_rows, max_len
        self.window, self.compact = window, compact
        self.pad_shapes, self.compiled = compile, compile
        self.done_check = DONE_CHECK_STEPS if self.device.type == "cuda" else 1   # a check waits for the GPU
        self.buffer: tuple[Tensor, Tensor] | None = None                   # (layers, R, Hkv, L, D) K and V
        self.caches: dict[tuple[int, int], StaticKV] = {}
        self.step, self.sample = self._step, draw
        if compile:
            cuda = self.device.type == "cuda"
            # rows and window are dynamic dimensions (`_dynamic`): one compile per cache length and variant
            mode = "reduce-overhead" if cuda else None                      # CUDA graphs on a GPU
            self.step = Compiled(self._step, path="decoding step", off=COMPILE_OFF, mode=mode, dynamic=False)
            if cuda:
                # one CUDA graph per (rows, window) met: a few windows per row bucket, each recorded once
                triton = torch._inductor.config.triton
                if triton.cudagraph_dynamic_shape_warn_limit is not None:
                    triton.cudagraph_dynamic_shape_warn_limit = max(triton.cudagraph_dynamic_shape_warn_limit, 64)
                # Not on CPU: inductor's vectorized C++ (torch 2.13, AVX-512) miscompiles the int64 hash of
                # the Gumbel noise (wrong values, heap corruption). bench/rollout.py checks the CUDA build.
                self.sample = Compiled(draw, path="decoding sampler", off=COMPILE_OFF, mode=mode, dynamic=False)

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """(rows, cache length) a call runs at: bucketed with pad_shapes, else as asked."""
        if not self.pad_shapes:
            return rows, length
        block = self.max_len or length
        return bucket(rows, self.max_rows), block * -(-length // block)

    def cache(self, rows: int, length: int) -> StaticKV:
        """The StaticKV of this shape: views of the buffer, which grows (the views dropped) if too small.
        Every shape's row r is the same memory, so compaction gathers rows within the buffer. A view holds
        SPARE columns past the cache length, never written nor attended: a window of the whole cache is
        then a strict slice like any other (one spanning the whole view would compile the step again)."""
        config = self.lm.config
        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        held = (0, 0) if self.buffer is None else (self.buffer[0].shape[1], self.buffer[0].shape[3] - SPARE)
        if rows > held[0] or length > held[1]:
            self.buffer, self.caches = None, {}                             # free the old one first
            dtype = torch.bfloat16 if self.bf16 else next(self.lm.parameters()).dtype
            size = (layers, max(rows, held[0]), kv_heads, max(length, held[1]) + SPARE, dim)
            # zeros, not empty: a masked column's weight is 0 and 0 x (finite stale value) = 0
            self.buffer = tuple(torch.zeros(size, dtype=dtype, device=self.device) for _ in range(2))
        key = (rows, length)
        if key not in self.caches:
            k, v = self.buffer
            kv = StaticKV([k[i, :rows, :, :length + SPARE] for i in range(layers)],
                          [v[i, :rows, :, :length + SPARE] for i in range(layers)])
            if self.compiled:
                _dynamic(*kv.keys, *kv.values, dims=(0,))
            self.caches[key] = kv
        return self.caches[key]

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _step(self, tokens: Tensor, positions: Tensor, key_valid: Tensor, kv: StaticKV) -> Tensor:
        """One token per row: tokens, positions (R,) long, key_valid (R, W) the window's columns ->
        next-token logits (R, V). The token is written at cache column kv.start (< W); it attends to
        the valid columns up to there."""
        columns = torch.arange(key_valid.shape[1], device=key_valid.device)
        mask = (key_valid & (columns <= kv.start))[:, None, None, :]         # (R, 1, 1, W)
        with self._autocast():
            out = self.twin(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                            past_key_values=kv, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _prefill(self, input_ids: Tensor, attention: Tensor, kv: StaticKV) -> Tensor:
        """The prompts (R, W), left-padded, into cache columns [0, W) -> logits of the first new token (R, V).

        A padding query attends to itself only (a row with nothing to attend to would give NaN
        keys and values); no real token attends to padding."""
        width = input_ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=self.device)
        mask = (causal[None] & attention.bool()[:, None, :]) | diagonal[None]  # (R, W, W)
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)            # skip left padding
        kv.start.fill_(0)
        # the last position by index, a contiguous (R, 1, H) copy: logits_to_keep=1 slices the (R, W, H)
        # hidden states, and a strided slice times a head without gradients (LoRA's frozen base, the bf16
        # twin) runs as a batched matmul that copies the (H, V) head once per row (on CPU, 4 s for 18 rows
        # of the 1.5B stand-in's 151,936-token vocabulary)
        last = torch.tensor([width - 1], device=self.device)
        with self._autocast():
            out = self.twin(input_ids=input_ids, attention_mask=mask[:, None], position_ids=positions,
                            past_key_values=kv, use_cache=True, logits_to_keep=last)
        return out.logits[:, -1]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy's current weights into the twin's bf16 copies (nothing to do in float32)."""
        for mine, source in self.pairs:
            mine.copy_(source)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention: Tensor, seeds: Tensor | None, temperature: float,
                 top_p: float, max_new_tokens: int, budgets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """input_ids, attention (N, P) left-padded on the device; seeds (N,) or None (greedy); budgets
        (N,) long, each row's most new tokens, in [1, max_new_tokens] (None: max_new_tokens each) ->
        (tokens (N, T'), log-probs (N, T')). A row ends at its first stop token or its budget; T' is
        the longest row's end. Past its end a row holds padding and log-prob 0."""
        self.refresh()
        real, width = input_ids.shape
        rows, length = self.shape(real, width + max_new_tokens)
        top = self.max_rows if self.pad_shapes else rows                    # the row buckets compaction uses
        kv = self.cache(rows, length)
        extra = rows - real                                                  # bucket rows: all padding, done
        input_ids = torch.cat([input_ids, input_ids.new_full((extra, width), self.pad_id)])
        attention = torch.cat([attention, attention.new_zeros((extra, width))])
        if seeds is not None:
            seeds = torch.cat([seeds, seeds.new_zeros(extra)])
        own = torch.full((real,), max_new_tokens, device=self.device) if budgets is None else \
            budgets.to(self.device)                                           # (N,)
        budgets = torch.cat([own, own.new_ones(extra)])                       # (R,)
        key_valid = torch.ones(rows, length + SPARE, dtype=torch.bool, device=self.device)   # (R, L + 1)
        key_valid[:, :width] = attention.bool()                               # generated columns are all real
        positions = attention.long().sum(1)                                   # (R,) of the first new token
        order = torch.arange(rows, device=self.device)                        # each row's index in the output
        done = order >= real
        tokens = torch.full((rows, max_new_tokens), self.pad_id, device=self.device)    # by output index
        logprobs = torch.zeros(rows, max_new_tokens, device=self.device)
        pad = torch.full((), self.pad_id, device=self.device)
        t = torch.zeros((), dtype=torch.int64, device=self.device)            # the Gumbel position
        logits = self._prefill(input_ids, attention, kv)
        columns = column_keys(logits.shape[-1], self.device)                 # outside the compiled sampler
        for step in range(max_new_tokens):
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()      # the last step's graph outputs are used up
            if step > 0:
                column = width + step - 1                                       # where the last token goes
                shown = window(column + 1, length) if self.window else length
                kv.start.fill_(column)
                fed, step_valid = positions + (step - 1), key_valid[:, :shown]   # (R,), (R, W)
                if self.compiled:
                    _dynamic(last, fed, step_valid, dims=(0,))
                    _dynamic(step_valid, dims=(1,))
                logits = self.step(last, fed, step_valid, kv)
            if self.compiled:
                _dynamic(logits, *([] if seeds is None else [seeds]), dims=(0,))
            choice, logp = self.sample(logits, seeds, t, temperature=temperature, top_p=top_p, columns=columns)
            last = torch.where(done, pad, choice)                             # generate pads finished rows
            tokens[order, step] = last
            logprobs[order, step] = torch.where(done, 0.0, logp)
            done = done | torch.isin(choice, self.stop_ids) | (budgets <= step + 1)
            t += 1
            if (step + 1) % self.done_check > 0:
                continue
            running = int((~done).sum())                                      # waits for the device
            if running == 0:
                break
            fit = bucket(max(running, MIN_ROWS), top)                          # rows the running ones need
            if self.compact and fit < len(order):
                keep = torch.argsort(done.int(), stable=True)[:fit].sort().values    # running rows first
                kv = self._gather(kv, keep, length, filled=width + step)
                last, positions, key_valid, done, budgets, order = (
                    x[keep] for x in (last, positions, key_valid, done, budgets, order))
                seeds = None if seeds is None else seeds[keep]
        return _cut(tokens[:real], logprobs[:real], self.stop_ids, own)

    def _gather(self, kv: StaticKV, keep: Tensor, length: int, filled: int) -> StaticKV:
        """The cache of rows `keep` (K,) ascending, in the StaticKV of K rows: their first `filled`
        columns (what is written so far), one layer at a time (a layer's K rows of copy at most)."""
        into = self.cache(len(keep), length)
        for source, target in zip(kv.keys + kv.values, into.keys + into.values):
            target[:, :, :filled] = source[keep, :, :filled]                  # the right side is a copy
        return into


def _dynamic(*tensors: Tensor, dims: tuple[int, ...]) -> None:
    """Mark these dimensions dynamic for torch.compile (rows, window): one compile serves every size
    but 1, which torch.compile specializes."""
    for x in tensors:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(x, d)


def row_ends(tokens: Tensor, stop_ids: Tensor, budgets: Tensor) -> Tensor:
    """Each row's end: 1 + the column of its first stop token within its budget, else its budget.
    tokens (N, T); budgets (N,) -> (N,). Tokens [7, 2, 5] with stop 2: 2 for a budget of 3, 1 for 1."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    is_stop = torch.isin(tokens, stop_ids) & (columns < budgets[:, None])   # (N, T)
    return torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, budgets)


def _cut(tokens: Tensor, logprobs: Tensor, stop_ids: Tensor, budgets: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the columns up to the longest row's end. tokens, logprobs (N, T); budgets (N,)."""
    width = int(row_ends(tokens, stop_ids, budgets).max())
    return tokens[:, :width], logprobs[:, :width]
