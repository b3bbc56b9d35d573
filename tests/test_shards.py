"""core/shards.py: sharing the measurement of weights out among ranks, and gathering only a
rank's share of whole weights under FSDP (torch FSDP on CPU with gloo, 2 processes)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from lalr_lightning.core import spectral
from lalr_lightning.core.layers import matrix_layers
from lalr_lightning.core.shards import assign_shares, gather_objects, whole_weights


def test_shares_balance_the_work_and_are_deterministic():
    costs = [100, 1, 1, 50, 49, 10]
    owner = assign_shares(costs, 2)
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in (0, 1)]
    assert sorted(load) == [102, 109]  # 100 | 50+49+10 | then 1, 1 to the lighter and owner == assign_shares(costs, 2)
    assert assign_shares(costs, 1) == [0] * len(costs)
    assert gather_objects({"a": 1}) == [{"a": 1}]  # no process group: just this rank


def _net():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(48, 10))


def _worker(rank, store, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # a file store, not TCP: with TCP rank 0 hosts the store and may exit while rank 1 still
    # tears down, which aborted rank 1 ("terminate called without an active exception") in CI
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = _net()
    layers = matrix_layers(model)  # found before wrapping, as the callbacks do in setup
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"),
                   auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    assert all(la.weight.ndim == 1 for la in layers)  # sharded views now
    owner = assign_shares([48 * 64] * len(layers), 2)
    mine = {la.name for la, o in zip(layers, owner) if o == rank}
    whole = whole_weights(wrapped, layers, mine)
    assert {la.name for la in whole} == mine and all(la.weight.ndim == 2 for la in whole)
    parts = gather_objects(spectral.alphas(whole, fit="median"))
    merged = {k: v for p in parts for k, v in p.items()}
    if rank == 0:
        # numpy, not tensors: a tensor crosses the queue as a shared fd that dies with this process
        out.put((merged, {la.name: la.weight.numpy() for la in whole}))
    dist.barrier()  # both ranks leave together
    dist.destroy_process_group()


def test_fsdp_ranks_gather_their_share_and_the_merged_alphas_equal_one_process(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401 - skip where FSDP is absent

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    merged, weights = out.get(timeout=60)
    model = _net()
    expected = spectral.alphas(matrix_layers(model), fit="median")
    assert merged == pytest.approx(expected, rel=1e-6) and set(merged) == set(expected)
    params = dict(model.named_parameters())
    for name, w in weights.items():
        assert torch.equal(torch.from_numpy(w), params[f"{name}.weight"]), name
