"""Rollout: counter-based sampling, the HF engine's tokens/masks/log-probs, and their agreement
with the trainer's log-probs."""
import math

import pytest
import torch

from pspo.data import builtin_arithmetic, format_prompt
from pspo.model import Policy, build_policy, load_tokenizer
from pspo.rollout import HFEngine, _GumbelSampler, _outside_nucleus, gumbel_noise
from pspo.sequences import batch_inputs, sequence_seeds


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
    policy = build_policy(tiny_model_path, False, 64, False, False)
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
