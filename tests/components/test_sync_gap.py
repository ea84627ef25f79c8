"""The sync check's gap, on a stand-in engine and trainer with hand-set log-probs (no vLLM needed)."""
import torch

from pspo.training.tokens import Rollout
from pspo.engines.vllm_engine import sync_gap


class FakeEngine:
    pad_id = 0

    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seeds):
        assert n == 1 and top_p == 1.0                 # one fresh completion per prompt, at top_p 1
        ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
        mask = torch.tensor([[1., 1, 0], [1, 1, 1]])   # first completion has 2 tokens, second 3
        logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
        return Rollout(ids, mask, logprobs, torch.tensor([False, True]), ["", ""], 0.0)


class FakePolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, T, temperature):
        # trainer log-probs: differ by .1, .3 on row 0 and 0, .2, .4 on row 1; -9 on the padding
        return torch.tensor([[-1.1, -1.7, -9.0], [-0.5, -0.7, -0.1]]), None


def test_sync_gap_hand_worked():
    # |Δ| over the 5 masked tokens: .1, .3, 0, .2, .4 -> max .4, mean 1.0 / 5 = .2 (padding ignored)
    gap_max, gap_mean = sync_gap(FakeEngine(), FakePolicy(), [[1, 2], [3]], temperature=0.7, max_new_tokens=3,
                                 seeds=torch.zeros(2, dtype=torch.long))
    assert abs(gap_max - 0.4) < 1e-6 and abs(gap_mean - 0.2) < 1e-6
