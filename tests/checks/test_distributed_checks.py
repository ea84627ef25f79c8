"""pspo/training/distributed.py: every collective runs on the process group's device (NCCL takes CUDA tensors
only) and hands its result back on the caller's device; and no other module calls torch.distributed
collectives, so the device rule holds everywhere.

No GPU here: a fake initialized group stands in for the backend. Its collectives record the device of
each tensor they are handed. FakeTensorMode lets a CPU-only torch make (shape-only) "cuda:1" tensors,
so a CPU tensor travelling to an NCCL group and back can be followed without a GPU.
"""
import ast
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pspo.training import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
               "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv"}


class FakeGroup:
    """A world of `world` identical ranks: all_reduce SUM multiplies by world (MAX leaves the value),
    all_gather repeats the tensor; every tensor handed over is recorded by device."""

    def __init__(self, monkeypatch, backend: str, world: int = 2):
        self.world, self.seen = world, []
        d = distributed.dist
        monkeypatch.setattr(d, "is_initialized", lambda: True)
        monkeypatch.setattr(d, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(d, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(d, "all_reduce", self.all_reduce)
        monkeypatch.setattr(d, "all_gather", self.all_gather)

    def all_reduce(self, t, op=None, group=None, async_op=False):
        self.seen.append(t.device)
        if op == distributed.dist.ReduceOp.SUM and not isinstance(t, FakeTensor):   # a fake has no values
            t.mul_(self.world)

    def all_gather(self, parts, t, group=None, async_op=False):
        self.seen.append(t.device)
        for part in parts:
            self.seen.append(part.device)
            if not isinstance(t, FakeTensor):
                part.copy_(t)


def test_group_device_follows_the_backend(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    assert distributed.group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert distributed.group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "gloo")
    assert distributed.group_device() == torch.device("cpu")


@pytest.mark.parametrize("caller", ["cpu", "cuda:0"])
def test_collectives_hand_nccl_a_cuda_tensor_and_return_on_the_callers_device(monkeypatch, caller):
    # An NCCL group on local rank 1: the backend must see cuda:1 whatever the caller's device
    # (SPO's whitening sums on the CPU: handed over as they are, NCCL would reject them).
    monkeypatch.setenv("LOCAL_RANK", "1")
    group = FakeGroup(monkeypatch, "nccl")
    calls = {"all_reduce_sum": lambda x: distributed.all_reduce_sum(x),
             "all_reduce_max": lambda x: distributed.all_reduce_max(x),
             "all_gather_rows": lambda x: distributed.all_gather_rows(x)}
    for name, call in calls.items():
        group.seen.clear()
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.ones(2, 3, device=caller)                                # (2, 3)
            out = call(x)
        assert group.seen and set(group.seen) == {torch.device("cuda", 1)}, (name, group.seen)
        assert out.device == torch.device(caller), name
        assert tuple(out.shape) == ((4, 3) if "gather" in name else (2, 3)), name    # gather: (world*2, 3)


def test_collectives_on_gloo_stay_on_cpu_with_the_right_values(monkeypatch):
    # gloo: CPU in, CPU to the backend, CPU out. World of 2 identical ranks:
    # sum [1, 2] -> [2, 4]; max [1, 2] -> [1, 2]; gather [[1, 2]] -> [[1, 2], [1, 2]];
    # ragged gather [1, 2] -> [1, 2, 1, 2]; reduce_sums {"a": 1.5, "b": 2} -> {"a": 3.0, "b": 4.0}.
    group = FakeGroup(monkeypatch, "gloo")
    x = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(x).tolist() == [2.0, 4.0]
    assert distributed.all_reduce_max(x).tolist() == [1.0, 2.0]
    assert distributed.all_gather_rows(x[None]).tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert distributed.all_gather_ragged(x).tolist() == [1.0, 2.0, 1.0, 2.0]   # lengths [2, 2], no padding kept
    assert distributed.reduce_sums({"b": 2.0, "a": 1.5}, torch.device("cpu")) == {"a": 3.0, "b": 4.0}
    assert x.tolist() == [1.0, 2.0]                                         # the input is never changed
    assert set(group.seen) == {torch.device("cpu")}


def test_ranks_that_pinned_different_attention_kernels_stop_together(monkeypatch):
    # Each FSDP rank probes the kernels on its own GPU (packed_attention.choose_kernels); before sharding, the
    # ranks compare what they pinned. Rank 1 of two refused varlen and pinned sdpa flash per sequence: every
    # rank stops with the same line naming both; ranks that agree go on.
    other = ["pspo_packed_sdpa_flash"]
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj, other[0]]
    monkeypatch.setattr(distributed.dist, "all_gather_object", all_gather_object)
    with pytest.raises(distributed.ConfigError) as e:
        distributed.same_attention("pspo_packed_varlen_flash")
    assert str(e.value) == ("train.attention: the ranks' probes chose different kernels (rank 0: "
                            "pspo_packed_varlen_flash; rank 1: pspo_packed_sdpa_flash); set train.attention to a "
                            "kernel every rank runs (math runs everywhere)")
    other[0] = "pspo_packed_varlen_flash"
    distributed.same_attention("pspo_packed_varlen_flash")


def test_world_of_one_needs_no_group():
    x = torch.tensor([1.0, 2.0])
    for out in (distributed.all_reduce_sum(x), distributed.all_reduce_max(x), distributed.all_gather_rows(x)):
        assert out.tolist() == [1.0, 2.0] and out.data_ptr() != x.data_ptr()  # a copy


def _collective_calls(path: str) -> list[str]:
    """'line: name' of each call of a torch.distributed collective in a Python file: through
    `torch.distributed.X`, an alias of the module (`import torch.distributed as dist`,
    `from torch import distributed`), or a name imported from it."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    aliases, names, found = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            found.append(f"{node.lineno}: {f.id}")
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            base = ast.unparse(f.value)
            if base in aliases or base == "torch.distributed":
                found.append(f"{node.lineno}: {base}.{f.attr}")
    return found


def test_the_checker_finds_each_spelling(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as dist\nfrom torch import distributed as td\n"
                   "from torch.distributed import all_gather as ag\n"
                   "dist.all_reduce(x)\ntd.barrier()\ntorch.distributed.broadcast(x, 0)\nag(p, x)\n"
                   "dist.is_initialized()\nother.all_reduce(x)\n")
    assert _collective_calls(str(src)) == ["5: dist.all_reduce", "6: td.barrier",
                                           "7: torch.distributed.broadcast", "8: ag"]


def test_only_distributed_py_calls_collectives():
    files = [os.path.join(ROOT, "train.py"), os.path.join(ROOT, "eval.py")]
    home = os.path.join(ROOT, "pspo", "training", "distributed.py")
    files += [os.path.join(folder, f) for folder, _, names in os.walk(os.path.join(ROOT, "pspo"))
              for f in sorted(names) if f.endswith(".py") and os.path.join(folder, f) != home]
    offenders = {os.path.relpath(f, ROOT): calls for f in files if (calls := _collective_calls(f))}
    assert offenders == {}, f"call pspo.training.distributed's functions instead: {offenders}"
    assert _collective_calls(home)                                            # the checker sees them there
