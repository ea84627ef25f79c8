"""The static-cache loop (pspo/engines/decode.py) against transformers `generate` (the engine's other loop):
the same tokens, masks, texts and log-probs in float32 on CPU, for fresh prompts and for prefixes;
completions independent of the shape buckets; early-stopping rows; the bf16 weight copies; the
compiled step. Its length-aware windows, row compaction and per-row budgets against the loop over
the whole cache with every row to the end (`Decoder(window=False, compact=False)`), and against an
independent recomputation: the model without a cache over each row's tokens and the Gumbel draw
written in this file from the documented formula."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from pspo.engines import decode, sampling
from pspo.training.config import ConfigError, load_config
from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.engines.decode import Decoder, decode_twin, row_ends, static_attention, window
from pspo.training.packed_attention import PACKED_ATTENTION
from pspo.training.model import build_policy, load_tokenizer
from pspo.engines.hf_engine import HFEngine
from pspo.rollout import compile_enabled
from pspo.engines.sampling import gumbel_noise
from pspo.training.tokens import batch_inputs, left_pad, stop_token_ids
from pspo.engines.sampling import prefix_seeds, sequence_seeds


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    problems = builtin_arithmetic("test")[:6]
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
           for ex in problems]
    ids[1] = ids[1][3:]                     # prompts of other lengths: left padding in every chunk
    static = HFEngine(policy, tokenizer, batch_size=64)
    reference = HFEngine(policy, tokenizer, batch_size=64, loop="generate")
    return tokenizer, policy, static, reference, ids


def assert_same_rollout(a, b):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.truncated, b.truncated) and a.texts == b.texts
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=2e-5, rtol=0)    # attention over more columns


@pytest.mark.parametrize("temperature, top_p, max_new, sampled", [
    (1.0, 1.0, 12, True), (0.7, 0.9, 12, True), (1.0, 1.0, 40, True), (1.0, 1.0, 12, False)])
def test_static_loop_equals_generate(tiny, temperature, top_p, max_new, sampled):
    # 40 new tokens: every row stops long before (completions of ~9 tokens): both cut the width at the
    # last row's stop token, the same column
    _, _, static, reference, ids = tiny
    seeds = sequence_seeds(5, 2, torch.arange(len(ids)), 4) if sampled else None
    n = 4 if sampled else 1
    a = static.generate(ids, n, temperature, top_p, max_new, seeds)
    b = reference.generate(ids, n, temperature, top_p, max_new, seeds)
    assert_same_rollout(a, b)
    if max_new == 40:
        assert a.completion_ids.shape[1] == int(a.mask.sum(1).max()) < 40 and not a.truncated.any()


def test_static_loop_equals_generate_on_prefixes(tiny):
    # four prompts continued from 3, 0, 5 and 6 tokens of a fresh completion, 3 continuations each,
    # budgets 8 - len(prefix): the rows of a chunk run to its largest budget and are cut to their own
    _, _, static, reference, ids = tiny
    first = reference.generate(ids[:4], 1, 1.0, 1.0, 12, sequence_seeds(2, 0, torch.arange(4), 1))
    lengths = first.mask.sum(1).long().tolist()
    prefixes = [first.completion_ids[i, :min(k, lengths[i] - 1)].tolist() for i, k in enumerate([3, 0, 5, 6])]
    seeds = prefix_seeds(2, 0, [p + q for p, q in zip(ids, prefixes)], 3)
    a = static.generate(ids[:4], 3, 1.0, 0.95, 8, seeds, prefix_ids=prefixes)
    b = reference.generate(ids[:4], 3, 1.0, 0.95, 8, seeds, prefix_ids=prefixes)
    assert_same_rollout(a, b)
    assert a.truncated.any() and not a.truncated.all()


def test_completions_do_not_depend_on_buckets_or_batch(tiny):
    # Padded shapes (what the compiled step runs): 6 prompts x 4 = 24 rows -> bucket 32 of 64 (8 padding
    # rows), the cache a multiple of 50 positions; one prompt alone: 4 rows, bucket 4. Neither the padding
    # rows, the longer cache nor the other prompts change a completion.
    tokenizer, policy, static, _, ids = tiny
    padded = HFEngine(policy, tokenizer, batch_size=64, max_len=50)
    padded.decoder.pad_shapes = True
    assert padded.decoder.shape(24, 30) == (32, 50) and padded.decoder.shape(4, 61) == (4, 100)
    seeds = sequence_seeds(3, 5, torch.arange(len(ids)), 4)
    plain = static.generate(ids, 4, 1.0, 0.95, 12, seeds)
    together = padded.generate(ids, 4, 1.0, 0.95, 12, seeds)
    alone = padded.generate(ids[4:5], 4, 1.0, 0.95, 12, seeds[16:20])
    assert_same_rollout(together, plain)
    width = alone.completion_ids.shape[1]
    assert alone.texts == plain.texts[16:20]
    assert torch.equal(alone.completion_ids, plain.completion_ids[16:20, :width])
    torch.testing.assert_close(alone.logprobs, plain.logprobs[16:20, :width], atol=2e-5, rtol=0)
    assert padded.decoder.buffer[0].shape[1:4:2] == (32, 50 + decode.SPARE)   # the one buffer, the largest shape


def test_rows_keep_running_after_their_stop_and_are_padded(tiny):
    # The loop looks for done rows once per DONE_CHECK_STEPS on a GPU: rows that stopped keep drawing
    # (padded) until the next check, the loop runs past the last stop, and the width is still cut there.
    tokenizer, _, static, _, ids = tiny
    seeds = sequence_seeds(1, 0, torch.arange(len(ids)), 2)
    every_step = static.generate(ids, 2, 1.0, 1.0, 40, seeds)
    static.decoder.done_check = 16
    try:
        every_16 = static.generate(ids, 2, 1.0, 1.0, 40, seeds)
    finally:
        static.decoder.done_check = 1
    assert_same_rollout(every_16, every_step)
    eos = tokenizer.eos_token_id
    lengths = every_step.mask.sum(1).long()
    assert lengths.min() < lengths.max()                            # rows stop at different steps
    for row, n in zip(every_step.completion_ids, lengths):
        assert row[n - 1] == eos and (row[n:] == tokenizer.pad_token_id).all()


def test_static_attention_equals_sdpa_with_repeated_heads():
    # 2 rows, 6 query heads over 2 KV heads (3 per group), 5 cache columns, head_dim 4; row 0 sees
    # columns 0-3, row 1 columns 2-4: the grouped matmul equals sdpa on KV heads repeated 3 times.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 4, generator=g)                                  # (R, H, 1, D)
    k, v = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)   # (R, Hkv, L, D)
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    out, _ = static_attention(None, q, k, v, mask, scaling=0.5)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                              attn_mask=mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    # a masked column holding NaN-free stale values changes nothing: its weight is exactly 0
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 4], v2[0, :, 4] = 1e4, -1e4
    torch.testing.assert_close(static_attention(None, q, k2, v2, mask, scaling=0.5)[0], out, atol=0, rtol=0)
    # a mask 4 columns wide reads the cache's first 4 only: column 4 may hold anything, even NaN
    narrow = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)[:, None, None, :]
    k2[:, :, 4], v2[:, :, 4] = float("nan"), float("nan")
    k4, v4 = k[:, :, :4].repeat_interleave(3, 1), v[:, :, :4].repeat_interleave(3, 1)
    expected = F.scaled_dot_product_attention(q, k4, v4, attn_mask=narrow, scale=0.5).transpose(1, 2)
    out, _ = static_attention(None, q, k2, v2, narrow, scaling=0.5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_row_ends_at_the_first_stop_within_the_budget():
    # stop id 2: [7, 2, 5, 2] ends at 2 with a budget of 4 or 2, at 1 with a budget of 1 (the stop is past it);
    # [2, 2, 2, 2] ends at 1; [7, 7, 7, 2] with a budget of 3 has no stop within it: 3
    tokens = torch.tensor([[7, 2, 5, 2], [7, 2, 5, 2], [7, 2, 5, 2], [2, 2, 2, 2], [7, 7, 7, 2]])
    assert row_ends(tokens, torch.tensor([2]), torch.tensor([4, 2, 1, 4, 3])).tolist() == [2, 2, 1, 1, 3]


def test_window_is_the_next_power_of_two_within_the_cache():
    # 201 filled columns -> 256; 256 -> 256 (2^8 holds them); 257 -> 512; 3000 -> 4096; a 50-position cache
    # caps 40 -> 64 at 50; 1 -> 1
    assert [window(n, 4096) for n in (201, 256, 257, 3000, 4096)] == [256, 256, 512, 4096, 4096]
    assert (window(40, 50), window(33, 50), window(32, 50), window(1, 50)) == (50, 50, 32, 1)


@pytest.fixture(scope="module")
def random_lm(tiny_model_path):
    """A random-weight 2-layer Qwen2 (4 query heads over 2 KV heads) with the tiny tokenizer: completions
    run on (its stop token is as likely as any), so rows end where their budgets say. Its head is
    scaled by 20 so that logits are not flat (top-2 gaps ~1, far above float32's rounding: greedy draws
    cannot tie)."""
    tokenizer = load_tokenizer(tiny_model_path)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        lm.lm_head.weight.mul_(20.0)
    g = torch.Generator().manual_seed(0)
    widths = torch.randint(3, 41, (24,), generator=g).tolist()                # prompts of 3-40 tokens
    prompts = [torch.randint(10, len(tokenizer), (w,), generator=g).tolist() for w in widths]
    return SimpleNamespace(lm=lm), stop_token_ids(tokenizer), tokenizer.pad_token_id, prompts


def recorded(decoder: Decoder) -> list[tuple[int, int]]:
    """The (rows, window) of every step the decoder runs from now on."""
    shapes, step = [], decoder.step

    def run(tokens, positions, key_valid, kv):
        shapes.append(tuple(key_valid.shape))
        return step(tokens, positions, key_valid, kv)
    decoder.step = run
    return shapes


@pytest.mark.parametrize("temperature, top_p, sampled, done_check, pad_shapes", [
    (1.0, 1.0, True, 1, False), (0.7, 0.9, True, 4, True), (1.0, 1.0, False, 16, True)])
def test_windows_and_compaction_decode_what_the_whole_cache_does(random_lm, temperature, top_p, sampled,
                                                                 done_check, pad_shapes):
    # 24 rows, prompts of 3-40 tokens (left-padded to 40), budgets spread from 1 to 150 new tokens,
    # 150^(i/23) rounded: 1, 1, 2, 2, 2, 3, 4, 5, ..., 97, 121, 150. With pad_shapes the rows are padded to
    # bucket 32 of 32 (8 padding rows) and the cache to 190 positions. The length-aware loop with compaction
    # draws the same tokens and log-probs (compaction changes the matmuls' row counts: rounding, ~1e-6);
    # done checks every 1, 4 or 16 steps (CPU, and the GPU's).
    policy, stop_ids, pad_id, prompts = random_lm
    input_ids, attention = left_pad(prompts, pad_id)
    budgets = torch.tensor([round(150 ** (i / 23)) for i in range(24)])
    seeds = sequence_seeds(3, 1, torch.arange(24), 1) if sampled else None
    outs, shapes = {}, {}
    for name, flags in (("full", dict(window=False, compact=False)), ("short", {})):
        decoder = Decoder(policy, stop_ids, pad_id, max_rows=32, **flags)
        decoder.pad_shapes, decoder.done_check = pad_shapes, done_check
        shapes[name] = recorded(decoder)
        outs[name] = decoder.generate(input_ids, attention, seeds, temperature, top_p, 150, budgets)
    (tokens, logprobs), (short_tokens, short_logprobs) = outs["full"], outs["short"]
    assert torch.equal(short_tokens, tokens)
    torch.testing.assert_close(short_logprobs, logprobs, atol=2e-5, rtol=0)
    # rows end at their budgets or stop tokens: each holds padding and log-prob 0 after its end
    ends = row_ends(tokens, torch.tensor(stop_ids), budgets)
    past = torch.arange(tokens.shape[1]) >= ends[:, None]
    assert (tokens[past] == pad_id).all() and (logprobs[past] == 0).all() and (logprobs[~past] < 0).all()
    assert tokens.shape[1] == int(ends.max()) and ends.min() <= 2 and ends.max() >= 97    # very different ends
    # the whole cache and every row at every step; the short loop in windows of 64, 128 and 190 columns
    # (prompt 40 + 150) and row buckets down to 2, reading at most a fifth of the columns
    rows = 32 if pad_shapes else 24
    assert set(shapes["full"]) == {(rows, 190)}
    windows, row_counts = {w for _, w in shapes["short"]}, {r for r, _ in shapes["short"]}
    assert windows == {64, 128, 190} and min(row_counts) == decode.MIN_ROWS == 2 and len(row_counts) >= 4
    read = sum(r * w for r, w in shapes["short"]) / sum(r * w for r, w in shapes["full"])
    assert read < 0.2 and len(shapes["short"]) == len(shapes["full"]) == tokens.shape[1] - 1 + (
        -(tokens.shape[1]) % done_check)                                  # the loop ends at a done check


# The counter-based Gumbel noise of docs (engines/sampling.py's module docstring), written again here with numpy's
# unsigned 64-bit integers (wrapping, logical shifts) rather than the engine's signed int64 emulation:
# h = mix(mix(seed + t·GOLDEN) + v·MUL1), mix the splitmix64 finalizer; u = (the top 24 bits of h + 0.5) / 2^24 in
# float32 (its rounding of + 0.5 is part of the definition); g = -log(-log u).
GOLDEN, MUL1, MUL2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def splitmix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * MUL1
    x = (x ^ (x >> np.uint64(27))) * MUL2
    return x ^ (x >> np.uint64(31))


def gumbel(seed: int, t: int, vocab: int) -> np.ndarray:
    """(V,) float64 noise of a completion's seed (a signed int64, as torch holds it) at position t."""
    key = splitmix(np.array([seed % 2 ** 64], dtype=np.uint64) + np.array([t], dtype=np.uint64) * GOLDEN)
    h = splitmix(key + np.arange(vocab, dtype=np.uint64) * MUL1)                   # (V,)
    u = ((h >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    return -np.log(-np.log(u.astype(np.float64)))


def independent_draw(logits: np.ndarray, seed: int | None, t: int, temperature: float,
                     top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(z, logp) of one position, float64, (V,) each: z's argmax is the token (greedy without a seed):
    z = logits / T outside the nucleus -inf, + the noise of (seed, t); the nucleus is the smallest set of
    the most probable tokens whose mass reaches top_p (a token is in while the mass before it is under
    top_p); logp = log softmax(logits / T)."""
    z = logits / temperature
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    if seed is None:
        return z, logp
    order = np.argsort(-logp, kind="stable")
    probs = np.exp(logp[order])
    outside = np.zeros(len(z), dtype=bool)
    outside[order] = np.cumsum(probs) - probs >= top_p
    return np.where(outside, -np.inf, z) + gumbel(seed, t, len(z)), logp


@pytest.mark.parametrize("temperature, top_p, sampled", [(1.0, 1.0, True), (0.7, 0.9, True), (1.0, 1.0, False)])
def test_windows_and_compaction_draw_what_an_independent_sampler_draws(random_lm, temperature, top_p, sampled):
    # The length-aware loop (windows 64 -> 128 -> 190, rows compacted down to buckets of 2) over 24 rows with
    # budgets 1..150 against a recomputation that shares none of its code: the model WITHOUT a cache over each
    # row's own prompt (unpadded) + the tokens it generated, in float32, and the draw written above from the
    # documented formula. Every token must be the independent draw's argmax; where the test's top two are
    # within 1e-4 (float32 rounding of a cached vs uncached forward) either is accepted, and the test counts them.
    policy, stop_ids, pad_id, prompts = random_lm
    input_ids, attention = left_pad(prompts, pad_id)
    budgets = torch.tensor([round(150 ** (i / 23)) for i in range(24)])
    seeds = sequence_seeds(7, 3, torch.arange(24), 1) if sampled else None
    decoder = Decoder(policy, stop_ids, pad_id, max_rows=32)
    decoder.pad_shapes = True
    shapes = recorded(decoder)
    tokens, logprobs = decoder.generate(input_ids, attention, seeds, temperature, top_p, 150, budgets)
    windows, row_counts = {w for _, w in shapes}, {r for r, _ in shapes}
    assert windows == {64, 128, 190} and min(row_counts) == 2 and len(row_counts) >= 4     # both act
    ends = row_ends(tokens, torch.tensor(stop_ids), budgets)
    assert ends.max() >= 97
    near_ties = checked = 0
    for i, prompt in enumerate(prompts):
        end = int(ends[i])
        row = tokens[i, :end].tolist()
        assert (tokens[i, end:] == pad_id).all() and (logprobs[i, end:] == 0).all()
        assert all(x not in stop_ids for x in row[:-1])                  # it ran on until its stop or budget
        assert row[-1] in stop_ids or end == int(budgets[i])
        with torch.no_grad():                                               # no cache, no padding, positions 0..
            logits = policy.lm(torch.tensor([prompt + row[:-1]])).logits[0, len(prompt) - 1:]   # (end, V)
        logits = logits.double().numpy()
        for t, token in enumerate(row):
            z, logp = independent_draw(logits[t], None if seeds is None else int(seeds[i]), t, temperature, top_p)
            expected = int(np.argmax(z))
            if token != expected:
                assert z[expected] - z[token] < 1e-4, (i, t, token, expected, z[expected] - z[token])
                near_ties += 1
            assert abs(float(logprobs[i, t]) - logp[token]) < 1e-4
            checked += 1
    assert checked == int(ends.sum()) > 500 and near_ties <= 2, near_ties


def test_budgets_end_rows_where_a_longer_run_passes(random_lm):
    # A row's draws depend on its seed and position only: with budgets [3, 40, 1, 17, ...] each row is the
    # first min(stop + 1, budget) tokens of the same rows run to 40 tokens, whatever the other rows do.
    policy, stop_ids, pad_id, prompts = random_lm
    input_ids, attention = left_pad(prompts[:8], pad_id)
    seeds = sequence_seeds(5, 0, torch.arange(8), 1)
    decoder = Decoder(policy, stop_ids, pad_id, max_rows=8)
    tokens, logprobs = decoder.generate(input_ids, attention, seeds, 1.0, 1.0, 40)
    budgets = torch.tensor([3, 40, 1, 17, 8, 2, 25, 5])
    short, short_logprobs = decoder.generate(input_ids, attention, seeds, 1.0, 1.0, 40, budgets)
    for row, budget in enumerate(budgets.tolist()):
        stops = [i for i, x in enumerate(tokens[row, :budget].tolist()) if x in stop_ids]
        end = stops[0] + 1 if stops else budget
        assert short[row, :end].tolist() == tokens[row, :end].tolist() and (short[row, end:] == pad_id).all()
        torch.testing.assert_close(short_logprobs[row, :end], logprobs[row, :end], atol=2e-5, rtol=0)
    assert short.shape[1] == 40 if 40 in budgets.tolist() else short.shape[1] < 40


def test_engine_loops_agree_on_prefixes_buckets_and_other_prompts(tiny):
    # The engine's default loop (windows, compaction, per-row budgets) against the whole-cache loop that runs
    # each chunk to its largest budget: SPO continuations with budgets 8 - len(prefix) = 5, 8, 3, 2, in a
    # padded bucket (12 rows -> 16 of 64, the cache a multiple of 50).
    tokenizer, policy, _, reference, ids = tiny
    first = reference.generate(ids[:4], 1, 1.0, 1.0, 12, sequence_seeds(2, 0, torch.arange(4), 1))
    lengths = first.mask.sum(1).long().tolist()
    prefixes = [first.completion_ids[i, :min(k, lengths[i] - 1)].tolist() for i, k in enumerate([3, 0, 5, 6])]
    seeds = prefix_seeds(2, 0, [p + q for p, q in zip(ids, prefixes)], 3)
    engines = [HFEngine(policy, tokenizer, batch_size=64, max_len=50) for _ in range(2)]
    engines[0].decoder.window = engines[0].decoder.compact = False
    shapes = []
    for engine in engines:
        engine.decoder.pad_shapes = True
        shapes.append(recorded(engine.decoder))
    full, short = (e.generate(ids[:4], 3, 1.0, 0.95, 8, seeds, prefix_ids=prefixes) for e in engines)
    assert_same_rollout(short, full)
    assert_same_rollout(short, reference.generate(ids[:4], 3, 1.0, 0.95, 8, seeds, prefix_ids=prefixes))
    assert full.truncated.any() and not full.truncated.all()
    # 7 steps after the prefill (8 new tokens at most): the whole loop at (16, 50) throughout; the short one
    # leaves the rows of budget 2 and 3 (6 of 12) after their third token, those of 5 after the fifth,
    # and reads a window of 32 columns (prompt + prefix: at most 18 + 6 tokens, then 7 more columns)
    assert shapes[0] == [(16, 50)] * 7
    assert [r for r, _ in shapes[1]] == [16, 16, 8, 8, 4, 4, 4] and {w for _, w in shapes[1]} == {32}


def test_bf16_twin_copies_track_the_policy(tiny_model_path):
    # model.bf16: the twin's linear weights are bf16 copies (autocast's values), refreshed before each
    # call; the embedding stays the policy's own float32 tensor; the policy's attention is untouched.
    tokenizer = load_tokenizer(tiny_model_path)
    policy = build_policy(tiny_model_path, chunk_tokens=64, bf16=True)
    twin, pairs = decode_twin(policy.lm, bf16=True)
    assert twin.model.embed_tokens.weight is policy.lm.model.embed_tokens.weight
    assert twin.lm_head.weight.dtype == torch.bfloat16 and policy.lm.lm_head.weight.dtype == torch.float32
    assert twin.config._attn_implementation == decode.STATIC_ATTENTION
    assert policy.lm.config._attn_implementation == PACKED_ATTENTION          # sdpa, or packed rows
    assert len(pairs) == 4 * 7 + 1 + 4 * 3                 # 7 linears a layer, the head, q/k/v biases
    engine = HFEngine(policy, tokenizer, batch_size=64)
    q_proj = policy.lm.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q_proj.add_(0.25)                                   # an optimizer step, in place
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
           for ex in builtin_arithmetic("test")[:4]]
    out = engine.generate(ids, 2, 1.0, 1.0, 10, sequence_seeds(0, 0, torch.arange(4), 2))
    mine = engine.decoder.twin.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(mine, q_proj.detach().to(torch.bfloat16))
    # its log-probs are the trainer's under bf16 autocast, to bf16 rounding
    rows = [p for p in ids for _ in range(2)]
    input_ids, attention = batch_inputs(rows, out.completion_ids, out.mask, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = policy(input_ids, attention, out.mask.shape[1], 1.0)
    assert ((logp - out.logprobs).abs() * out.mask).max() < 0.1


def test_gumbel_position_as_a_tensor_is_the_same_noise():
    seeds = sequence_seeds(0, 0, torch.arange(8), 2)
    assert torch.equal(gumbel_noise(seeds, torch.tensor(3), 50), gumbel_noise(seeds, 3, 50))


def test_column_keys_are_the_wrapped_products_and_the_same_noise():
    # arange(4) x MUL1 (0xBF58476D1CE4E5B9) mod 2^64, as signed int64: 0, -4658895280553007687,
    # 2 x 0xBF58476D1CE4E5B9 = 0x17EB08EDA39C9CB72 -> 0x7EB08EDA39C9CB72 = 9128953512603536242, ...
    keys = sampling.column_keys(4)
    assert keys.tolist() == [0, -4658895280553007687, 9128953512603536242, 4470058232050528555]
    seeds = sequence_seeds(0, 0, torch.arange(8), 2)
    assert torch.equal(gumbel_noise(seeds, 3, 50, sampling.column_keys(50)), gumbel_noise(seeds, 3, 50))


def test_compile_setting_resolves_by_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (compile_enabled("auto", cpu), compile_enabled("auto", cuda)) == (False, True)
    assert (compile_enabled("always", cpu), compile_enabled("never", cuda)) == (True, False)
    assert load_config(None, ["--rollout.compile=always"]).rollout.compile == "always"
    with pytest.raises(ConfigError, match="rollout.compile: expected auto | always | never"):
        load_config(None, ["--rollout.compile=true"])


@pytest.mark.slow
def test_compiled_step_equals_the_eager_loop(tiny):
    # torch.compile (inductor's C++ backend here; CUDA graphs on a GPU) of the decoding step: the same
    # tokens as the eager loop, for two row buckets (24 rows -> 32, 8 -> 8) and a second call that
    # reuses the first compile. The first call compiles (~15 s on 2 cores).
    tokenizer, policy, static, _, ids = tiny
    compiled = HFEngine(policy, tokenizer, batch_size=64, compile=True)
    for prompts, n, step in ((ids, 4, 0), (ids[:2], 4, 1), (ids, 4, 2)):
        seeds = sequence_seeds(7, step, torch.arange(len(prompts)), n)
        eager = static.generate(prompts, n, 1.0, 1.0, 12, seeds)
        assert_same_rollout(compiled.generate(prompts, n, 1.0, 1.0, 12, seeds), eager)


@pytest.mark.slow
def test_compiled_step_compiles_once_for_every_rows_and_window(random_lm, capsys):
    # The rows and the window are dynamic dimensions: 24 rows (bucket 32) ending at budgets 1..150 meet 7
    # (rows, window) shapes, 32 x 64 to 2 x 190, and dynamo compiles the step once, not once per shape; the
    # tokens are the eager loop's. Inductor's C++ backend here (~20 s on 2 cores).
    from torch._dynamo.utils import counters
    policy, stop_ids, pad_id, prompts = random_lm
    input_ids, attention = left_pad(prompts, pad_id)
    budgets = torch.tensor([round(150 ** (i / 23)) for i in range(24)])
    seeds = sequence_seeds(3, 2, torch.arange(24), 1)
    eager = Decoder(policy, stop_ids, pad_id, max_rows=32)
    eager.pad_shapes = True
    compiled = Decoder(policy, stop_ids, pad_id, max_rows=32, compile=True)
    shapes = recorded(compiled)
    before = counters["stats"]["unique_graphs"]
    tokens, logprobs = compiled.generate(input_ids, attention, seeds, 1.0, 1.0, 150, budgets)
    graphs = counters["stats"]["unique_graphs"] - before
    assert "torch.compile failed" not in capsys.readouterr().err
    assert len(set(shapes)) >= 6 and graphs == 1
    expected, expected_logprobs = eager.generate(input_ids, attention, seeds, 1.0, 1.0, 150, budgets)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=2e-5, rtol=0)


def test_transformers_static_cache_generate_equals_generate(tiny):
    # HFEngine(loop="generate-static"): transformers' own StaticCache of max_len positions (the GPU check's
    # decode section times it against the static loop); in float32 the same tokens and log-probs as generate
    tokenizer, policy, _, reference, ids = tiny
    engine = HFEngine(policy, tokenizer, batch_size=64, max_len=64, loop="generate-static")
    seeds = sequence_seeds(5, 0, torch.arange(len(ids)), 2)
    assert_same_rollout(engine.generate(ids, 2, 1.0, 1.0, 10, seeds), reference.generate(ids, 2, 1.0, 1.0, 10, seeds))
