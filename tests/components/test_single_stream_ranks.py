"""Single-stream PO's tracker on two ranks (pspo/related/single_stream.py): each rank scores the stored
completions of its own prompts, a rank without one takes part in the scoring with a stand-in row, and the drifts
and completions are gathered, so both ranks hold the state one process holds after the same global batches."""
import os

import pytest
import torch

from conftest import LinearLogprobs
from pspo.related.single_stream import ValueTracker
from pspo.training.checkpoint import state_digest
from pspo.training.config import load_config
from pspo.training.distributed import Dist
from pspo.training.tokens import Rollout

TRAIN_IDS = [[1, 2], [3], [4], [5, 6], [7], [8, 9]]
COMPLETIONS = torch.tensor([[2, 2, 2], [6, 0, 0], [3, 3, 0], [5, 0, 0]])      # (B, T) the same ids every step
MASK = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
# step 2: rank 0's prompts 0, 1 are revisits, rank 1's 4, 5 are not (its stand-in row); step 3 mixes both
STEPS = [([0, 1, 2, 3], [1.0, 0, 1, 1], 0.1), ([0, 1, 4, 5], [0.0, 1, 1, 0], 0.11),
         ([2, 4, 0, 3], [1.0, 1, 0, 0], 0.13)]




def run_steps(rank: int, world: int) -> dict:
    """The tracker's state after STEPS, B = 4 prompts of G = 1, this rank holding its 4 / world of them."""
    cfg = load_config("configs/single_stream.yaml", ["--train.prompts_per_step=4", "--pps.replacement=false",
                                                     "--single_stream.rho_min=0.5"], world_size=world)
    tracker = ValueTracker(cfg, TRAIN_IDS, 0, Dist(rank, world, torch.device("cpu")))
    B_local = 4 // world
    mine = slice(rank * B_local, (rank + 1) * B_local)
    for indices, rewards, scale in STEPS:
        ids, mask = COMPLETIONS[mine], MASK[mine]
        rollout = Rollout(ids, mask, torch.zeros_like(mask), torch.zeros(B_local, dtype=torch.bool), [""] * B_local, 0)
        tracker.visit(LinearLogprobs(scale), indices=torch.tensor(indices), mine=mine,
                      rewards=torch.tensor(rewards)[:, None], rollout=rollout, old_logp=-scale * ids.float() * mask)
    return tracker.state_dict()


def _on_rank(rank, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.save(run_steps(rank, 2), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


@pytest.mark.slow
def test_two_ranks_hold_the_state_of_one_process(tmp_path, forked_ranks):
    forked_ranks(_on_rank, (str(tmp_path / "init"), str(tmp_path)))
    one = run_steps(0, 1)
    # prompt 1: step 1, r = 0, first visit (ρ = .96): α = .48, β = 1.48; step 2, r = 1, its stored token 6 moved
    # from -.6 to -.66: D = .06 = D_half, ρ = .5: α = .5·.48 + 1 = 1.24, β = .5·1.48 = .74
    assert (one["alpha"][1].item(), one["beta"][1].item()) == pytest.approx((1.24, 0.74))
    assert one["visits"].tolist() == [3, 2, 2, 2, 2, 1] and one["rows"].tolist() == [0, 1, 2, 3, 4, 5]
    for rank in (0, 1):
        assert state_digest(torch.load(tmp_path / f"rank{rank}.pt")) == state_digest(one), rank
