"""Rollout: counter-based sampling, the HF engine's tokens/masks/log-probs, and their agreement
with the trainer's log-probs."""
import math

import pytest
import torch

from pspo.tasks.data import builtin_arithmetic, format_prompt
from pspo.training.model import build_policy, load_tokenizer
from pspo.rollout import CountingEngine
from pspo.training.metrics import GenerationCounts
from pspo.engines.hf_engine import HFEngine, _GumbelSampler
from pspo.engines.sampling import gumbel_noise, outside_nucleus as _outside_nucleus
from pspo.training.tokens import batch_inputs, continuation_inputs
from pspo.engines.sampling import child_seeds, prefix_seeds, sequence_seeds


def test_nucleus_hand_worked():
    # p = [.5, .3, .15, .05]; mass of strictly better tokens = [0, .5, .8, .95].
    # top_p .8: drop where that mass >= .8 -> tokens 2, 3. top_p .81: drop only token 3.
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert _outside_nucleus(logp, 0.8).tolist() == [[False, False, True, True]]
    assert _outside_nucleus(logp, 0.81).tolist() == [[False, False, False, True]]
    assert _outside_nucleus(logp[:, [3, 2, 1, 0]], 0.8).tolist() == [[True, True, False, False]]  # any order


def test_gumbel_noise_is_deterministic_and_gumbel_distributed():
    seeds = sequence_seeds(0, 0, torch.arange(1000), 4)              # (4000,)
    assert len(set(seeds.tolist())) == 4000                           # no collisions
    g = gumbel_noise(seeds, 3, 50)
    assert torch.equal(g, gumbel_noise(seeds, 3, 50))
    assert not torch.equal(g, gumbel_noise(seeds, 4, 50))             # a new draw per position
    # Gumbel(0,1): mean = Euler-Mascheroni 0.5772, variance = pi^2/6 = 1.6449
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03


def test_continuation_seeds_are_keyed_by_content_or_parent():
    states = [[5, 6, 7], [5, 6], [], [7, 6, 5], [5, 6, 7]]
    seeds = prefix_seeds(0, 3, states, 2).view(5, 2)                       # (U, n)
    assert torch.equal(seeds[0], seeds[4])                                # same tokens, same seeds, any position
    assert torch.equal(prefix_seeds(0, 3, states[4:], 2), seeds[4])       # ... and in any batch
    assert len(set(seeds[:4].flatten().tolist())) == 8                    # a prefix, an order, the empty state differ
    assert not torch.equal(prefix_seeds(0, 4, states, 2), prefix_seeds(0, 3, states, 2))   # a new step
    assert not torch.equal(prefix_seeds(1, 3, states, 2), prefix_seeds(0, 3, states, 2))   # a new run seed
    many = prefix_seeds(0, 0, [[i, j] for i in range(100) for j in range(100)], 4)
    assert len(set(many.tolist())) == 40000                               # no collisions
    parents = sequence_seeds(0, 0, torch.arange(100), 6)                  # (600,)
    kids = child_seeds(parents, 6)                                        # (3600,)
    assert len(set(kids.tolist()) | set(parents.tolist())) == 4200
    assert torch.equal(child_seeds(parents[6:12], 6), kids[36:72])        # a node's children: its seed alone


def test_continuation_inputs_join_and_budget():
    # prompts [1, 2] and [3] continuing [7] and [8, 9] within 5 new tokens: budgets 4 and 3
    assert continuation_inputs([[1, 2], [3]], [[7], [8, 9]], 5) == ([[1, 2, 7], [3, 8, 9]], [4, 3])
    assert continuation_inputs([[1, 2], [3]], None, 5) == ([[1, 2], [3]], [5, 5])
    with pytest.raises(ValueError, match="prefix_ids"):
        continuation_inputs([[1]], [[7] * 5], 5)                          # nothing left to generate
    with pytest.raises(ValueError, match="prefix_ids"):
        continuation_inputs([[1], [2]], [[7]], 5)


def test_gumbel_sampler_draws_from_softmax_over_temperature():
    # logits [2, 1, 0, -1] at T = 2 -> softmax([1, .5, 0, -.5]):
    # exp = [2.71828, 1.64872, 1, .60653], sum 5.97353 -> [.45505, .27600, .16740, .10154]
    expected = torch.tensor([0.45505, 0.27600, 0.16740, 0.10154])
    n = 40000
    sampler = _GumbelSampler(sequence_seeds(7, 0, torch.arange(n), 1), prompt_len=0, temperature=2.0, top_p=1.0)
    scores = sampler(torch.zeros(n, 0, dtype=torch.long), torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(n, 1))
    freq = torch.bincount(scores.argmax(-1), minlength=4).float() / n
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    # recorded log-prob is log softmax(z / T) of the chosen token
    chosen = scores.argmax(-1)
    torch.testing.assert_close(sampler.logprobs[0], expected.log()[chosen], atol=1e-3, rtol=0)
    # top_p .6: nucleus {0, 1} (mass before token 2 is .73105 >= .6) -> renormalized
    # [.45505, .27600] / .73105 = [.62246, .37754]
    sampler = _GumbelSampler(sequence_seeds(7, 0, torch.arange(n), 1), 0, 2.0, 0.6)
    picks = sampler(torch.zeros(n, 0, dtype=torch.long), torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(n, 1)).argmax(-1)
    freq = torch.bincount(picks, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.62246, 0.37754, 0, 0]), atol=0.01, rtol=0)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    engine = HFEngine(policy, tokenizer, batch_size=64)
    problems = builtin_arithmetic("test")[:6]
    ids = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"] for ex in problems]
    return tokenizer, policy, engine, ids


def test_engine_logprobs_match_trainer(tiny):
    tokenizer, policy, engine, ids = tiny
    G = 4
    out = engine.generate(ids, G, temperature=0.8, top_p=1.0, max_new_tokens=12,
                          seeds=sequence_seeds(0, 0, torch.arange(len(ids)), G))
    assert out.completion_ids.shape == out.mask.shape == out.logprobs.shape
    rows = [p for p in ids for _ in range(G)]
    input_ids, attention = batch_inputs(rows, out.completion_ids, out.mask, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = policy(input_ids, attention, out.mask.shape[1], 0.8)
    torch.testing.assert_close(logp * out.mask, out.logprobs, atol=1e-4, rtol=0)
    assert (out.logprobs[out.mask.bool()] < 0).all()


def test_engine_masks_stop_at_eos_and_flag_truncation(tiny):
    tokenizer, _, engine, ids = tiny
    out = engine.generate(ids, 2, 1.0, 1.0, max_new_tokens=12, seeds=sequence_seeds(1, 0, torch.arange(len(ids)), 2))
    eos = tokenizer.eos_token_id
    for row, m, trunc in zip(out.completion_ids, out.mask, out.truncated):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()                        # one contiguous prefix
        assert (row[n:] == tokenizer.pad_token_id).all()
        assert (row[n - 1] == eos) != bool(trunc)                     # ends at EOS unless truncated
        assert eos not in row[:n - 1].tolist()
    short = engine.generate(ids, 2, 1.0, 1.0, max_new_tokens=2, seeds=sequence_seeds(1, 0, torch.arange(len(ids)), 2))
    ends_at_eos = short.completion_ids.gather(1, short.mask.sum(1, keepdim=True).long() - 1).squeeze(1) == eos
    assert short.mask.sum(1).le(2).all() and short.truncated.any()
    assert torch.equal(short.truncated, ~ends_at_eos)             # truncated = cut before its EOS


def test_completion_does_not_depend_on_batch_or_split(tiny):
    # The same seeds give the same completions whether a prompt is generated with others or alone
    # (this is what lets a 2-rank run reproduce a 1-rank run).
    tokenizer, _, engine, ids = tiny
    seeds = sequence_seeds(3, 5, torch.arange(len(ids)), 3)
    together = engine.generate(ids, 3, 1.0, 0.95, 12, seeds)
    alone = engine.generate(ids[4:], 3, 1.0, 0.95, 12, seeds[12:])
    assert together.texts[12:] == alone.texts
    small_calls = HFEngine(engine.model, tokenizer, batch_size=3).generate(ids, 3, 1.0, 0.95, 12, seeds)
    assert small_calls.texts == together.texts
    other = engine.generate(ids, 3, 1.0, 0.95, 12, sequence_seeds(4, 5, torch.arange(len(ids)), 3))
    assert other.texts != together.texts                              # a different seed differs


def test_greedy_matches_plain_generate(tiny):
    tokenizer, policy, engine, ids = tiny
    out = engine.generate(ids[:2], 1, 1.0, 1.0, 12, seeds=None)
    for i, p in enumerate(ids[:2]):
        ref = policy.lm.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(ref[0, len(p):], skip_special_tokens=True)
        assert out.texts[i] == text


def continuation_case(engine, ids):
    """Four prompts continued from 3, 0, 5 and 6 tokens of a fresh completion (8-9 tokens long here);
    3 continuations each."""
    first = engine.generate(ids[:4], 1, 1.0, 1.0, 12, sequence_seeds(2, 0, torch.arange(4), 1))
    lengths = first.mask.sum(1).long().tolist()
    prefixes = [first.completion_ids[i, :min(k, lengths[i] - 1)].tolist() for i, k in enumerate([3, 0, 5, 6])]
    seeds = prefix_seeds(2, 0, [p + q for p, q in zip(ids, prefixes)], 3)   # (12,)
    return prefixes, seeds


def test_continuations_do_not_depend_on_batch_and_follow_the_prefix(tiny):
    tokenizer, policy, engine, ids = tiny
    prefixes, seeds = continuation_case(engine, ids)
    together = engine.generate(ids[:4], 3, 1.0, 0.95, 8, seeds, prefix_ids=prefixes)   # budgets 5, 8, 3, 2
    alone = engine.generate(ids[2:3], 3, 1.0, 0.95, 8, seeds[6:9], prefix_ids=prefixes[2:3])
    assert together.texts[6:9] == alone.texts
    assert torch.equal(together.completion_ids[6:9, :alone.completion_ids.shape[1]], alone.completion_ids)
    small_calls = HFEngine(engine.model, tokenizer, batch_size=3).generate(ids[:4], 3, 1.0, 0.95, 8, seeds,
                                                                           prefix_ids=prefixes)
    assert small_calls.texts == together.texts
    # each continuation stays within 8 - len(prefix) new tokens, and is truncated exactly when it fills them
    budget = torch.tensor([8 - len(q) for q in prefixes]).repeat_interleave(3)
    lengths = together.mask.sum(1).long()
    assert (lengths <= budget).all() and torch.equal(together.truncated, ~torch.isin(
        together.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), torch.tensor(engine.stop_ids)))
    assert together.truncated.any() and (lengths[together.truncated] == budget[together.truncated]).all()
    # the texts are the whole completions, and the log-probs the trainer's given prompt + prefix
    rows = [q for q in prefixes for _ in range(3)]
    assert together.texts == tokenizer.batch_decode([q + r[m.bool()].tolist() for q, r, m in zip(
        rows, together.completion_ids, together.mask)], skip_special_tokens=True)
    inputs = [p + q for p, q in zip(ids, prefixes) for _ in range(3)]
    input_ids, attention = batch_inputs(inputs, together.completion_ids, together.mask, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = policy(input_ids, attention, together.mask.shape[1], 1.0)
    torch.testing.assert_close(logp * together.mask, together.logprobs, atol=1e-4, rtol=0)


def test_greedy_continuation_completes_the_greedy_completion(tiny):
    # continuing the first k tokens of a greedy completion greedily gives back the rest of it
    tokenizer, _, engine, ids = tiny
    full = engine.generate(ids[:4], 1, 1.0, 1.0, 12, None)
    lengths = full.mask.sum(1).long().tolist()
    for k in (1, 4, 8):
        prefixes = [full.completion_ids[i, :min(k, lengths[i] - 1)].tolist() for i in range(4)]
        rest = engine.generate(ids[:4], 1, 1.0, 1.0, 12, None, prefix_ids=prefixes)
        assert rest.texts == full.texts and torch.equal(rest.truncated, full.truncated)
        for i, q in enumerate(prefixes):
            assert rest.completion_ids[i, :lengths[i] - len(q)].tolist() == full.completion_ids[i, len(q):lengths[i]].tolist()


def test_counting_engine_counts_every_returned_token_by_kind(tiny):
    # a fresh rollout of 2 prompts x 2, then 3 continuations of 2 prefixes, then another rollout:
    # rollout_tokens = the two rollouts' mask sums, mc_tokens = the continuations', calls 2 and 1
    tokenizer, _, engine, ids = tiny
    counter = CountingEngine(engine)
    a = counter.generate(ids[:2], 2, 1.0, 1.0, 12, sequence_seeds(0, 0, torch.arange(2), 2))
    prefixes = [a.completion_ids[0, :2].tolist(), a.completion_ids[2, :3].tolist()]
    b = counter.generate(ids[:2], 3, 1.0, 1.0, 12, prefix_seeds(0, 0, [p + q for p, q in zip(ids, prefixes)], 3),
                         prefix_ids=prefixes)
    c = counter.generate(ids[2:3], 1, 1.0, 1.0, 12, sequence_seeds(0, 0, torch.arange(1), 1))
    counts = counter.take()
    assert counts.rollout_tokens == a.mask.sum() + c.mask.sum() and counts.mc_tokens == b.mask.sum() > 0
    assert (counts.rollout_calls, counts.mc_calls) == (2, 1)
    assert counts.mc_gen_s == b.gen_time_s and counts.rollout_gen_s == a.gen_time_s + c.gen_time_s
    assert counter.take() == GenerationCounts()                           # take() starts a new step, all 0
