"""Uniform prompt sampler: shuffled epochs, same order on every rank, exact resume."""
import torch

from pspo.sampler import UniformSampler


def test_every_prompt_once_per_epoch_and_deterministic():
    a, b = UniformSampler(10, seed=3), UniformSampler(10, seed=3)
    first = torch.cat([a.sample(4) for _ in range(5)])           # 20 draws = 2 epochs
    assert sorted(first[:10].tolist()) == list(range(10))        # epoch 0 is a permutation
    assert sorted(first[10:].tolist()) == list(range(10))        # so is epoch 1
    assert not torch.equal(first[:10], first[10:])               # and they differ
    assert torch.equal(first, torch.cat([b.sample(4) for _ in range(5)]))   # same seed, same order
    assert not torch.equal(first[:10], UniformSampler(10, seed=4).sample(10))


def test_state_dict_resumes_exactly():
    s = UniformSampler(7, seed=1)
    s.sample(5)
    state = s.state_dict()                                        # mid-epoch: epoch 0, position 5
    assert (state["epoch"], state["position"]) == (0, 5)
    expected = [s.sample(5) for _ in range(3)]
    t = UniformSampler(7, seed=1)
    t.load_state_dict(state)
    assert all(torch.equal(x, t.sample(5)) for x in expected)


def test_batch_larger_than_dataset_wraps():
    idx = UniformSampler(3, seed=0).sample(7)
    assert len(idx) == 7 and set(idx.tolist()) == {0, 1, 2}
