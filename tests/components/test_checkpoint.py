"""The replicated-state digest that checkpoints compare across ranks, and unreadable checkpoint files."""
import torch

from pspo.training.checkpoint import state_digest
from pspo.ema_stats import EMAStats
from pspo.priority_sampler import PrioritySampler


def state(sampler, ers):
    return {"step": 3, "sampler": sampler.state_dict(), "ers": ers.state_dict()}


def test_digest_is_equal_for_equal_state_and_sensitive_to_any_change():
    def build():
        s, e = PrioritySampler(10, seed=1), EMAStats(0.9)
        idx = s.sample(4)
        s.set_priorities(idx, torch.rand(4, 3, generator=torch.Generator().manual_seed(0)))
        e.smooth(["a", "b"], torch.tensor([[1., 0, 1], [0, 0, 1]]))
        return s, e
    s1, e1 = build()
    s2, e2 = build()
    d = state_digest(state(s1, e1))
    assert d == state_digest(state(s2, e2)) and len(d) == 32
    assert d == state_digest(dict(reversed(list(state(s2, e2).items()))))   # key order does not matter
    e2.mean[0] = torch.nextafter(e2.mean[0], torch.tensor(2.0, dtype=torch.float64))   # one ulp
    assert state_digest(state(s2, e2)) != d
    s3, e3 = build()
    s3.sample(1)                                                             # RNG and step counter move
    assert state_digest(state(s3, e3)) != d


def test_a_corrupt_checkpoint_file_is_one_line(tmp_path):
    # a truncated/garbage trainer_state.pt must not end in a traceback: one line naming the file
    import pytest
    from pspo.training.checkpoint import CheckpointError, load_trainer_state
    (tmp_path / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="train.resume: cannot read .*trainer_state.pt") as e:
        load_trainer_state(str(tmp_path), 0)
    assert "\n" not in str(e.value)
    torch.save({"something": 1}, tmp_path / "trainer_state.pt")      # readable, but not ours
    with pytest.raises(CheckpointError, match="is not a pspo trainer state"):
        load_trainer_state(str(tmp_path), 0)
