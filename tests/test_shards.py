"""core/runtime/shards.py: sharing the measurement of weights out among ranks, gathering only a rank's
share of whole weights under FSDP1 and FSDP2, and cutting other tensors like the weights (torch
FSDP on CPU with gloo, one pair of processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _dist import run_pair
from torch import nn

from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.runtime.shards import ShardLayout, assign_shares, gather_objects, whole_weights
from lalr_lightning.core.spectral import htsr


def test_shares_balance_the_work_and_are_deterministic():
    costs = [100, 1, 1, 50, 49, 10]
    owner = assign_shares(costs, 2)
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in (0, 1)]
    assert sorted(load) == [102, 109]  # 100 | 50+49+10 | then 1, 1 to the lighter and owner == assign_shares(costs, 2)
    assert assign_shares(costs, 1) == [0] * len(costs)
    assert gather_objects({"a": 1}) == [{"a": 1}]  # no process group: just this rank


def test_a_layout_without_sharding_is_the_identity():
    p = nn.Parameter(torch.randn(3, 4))
    layout = ShardLayout(nn.Linear(2, 2))
    full = torch.randn(3, 4)
    assert not layout.sharded(p) and layout.shape(p) == (3, 4)
    assert torch.equal(layout.local(p, full), full) and torch.equal(layout.whole(p, full), full)


def _net():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(48, 10))


def _shard(kind: str, model: nn.Module) -> nn.Module:
    """The root of ``model`` wrapped as ``kind``: FSDP1 units per block inside a root unit (the
    head in the root's own flat parameter), or FSDP2 per block and then the whole."""
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"),
                    auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for block in list(model)[:3]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _pair(rank, record):
    for kind in ("fsdp1", "fsdp2"):
        model = _net()
        if kind == "fsdp1":
            layers = matrix_layers(model)  # found before wrapping, as the callbacks do in setup
        root = _shard(kind, model)
        if kind == "fsdp2":  # fully_shard puts new parameters in place: found after it
            layers = matrix_layers(model)
        assert all(la.weight.ndim == 1 for la in layers) or kind == "fsdp2"  # FSDP1: this rank's piece
        owner = assign_shares([48 * 64] * len(layers), 2)
        mine = {la.name for la, o in zip(layers, owner) if o == rank}
        whole = whole_weights(root, layers, mine)  # the head is in the root unit: gathered through it
        assert {la.name for la in whole} == mine and all(la.weight.ndim == 2 for la in whole)
        parts = gather_objects(htsr.alphas(whole, fit="median"))
        # a mask cut like each weight and put back together is the mask again; the pieces are where
        # the rank's own piece of the weight is
        layout = ShardLayout(root)
        g = torch.Generator().manual_seed(1)
        back = {}
        for la in layers:
            p = la.weight
            full = torch.rand(layout.shape(p), generator=g) > 0.5
            piece = layout.local(p, full)
            assert piece.shape == p.shape and layout.sharded(p)
            back[la.name] = bool(torch.equal(layout.whole(p, piece), full))
        record(kind, ({k: v for part in parts for k, v in part.items()},
                      {la.name: la.weight.numpy() for la in whole}, back))


def test_fsdp_ranks_gather_their_share_through_the_root_and_cut_tensors_like_the_weights(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401 - skip where FSDP is absent

    runs = run_pair(_pair, tmp_path)
    model = _net()
    expected = htsr.alphas(matrix_layers(model), fit="median")
    params = dict(model.named_parameters())
    for kind in ("fsdp1", "fsdp2"):
        seen = {}
        for rank in (0, 1):
            assert kind in runs[rank], f"rank {rank} stopped before {kind} (see the output)"
            merged, weights, back = runs[rank][kind]
            assert merged == pytest.approx(expected, rel=1e-6) and set(merged) == set(expected), kind
            assert all(back.values()), (kind, back)
            seen.update(weights)
        assert set(seen) == set(expected)  # every layer measured by one rank or the other
        for name, w in seen.items():
            assert np.array_equal(w, params[f"{name}.weight"].detach().numpy()), (kind, name)


# ---------------------------------------------------------------------- a whole copy from a state dict


@pytest.mark.parametrize("family, tied", [("llama", False), ("llama", True), ("gpt2", True), ("opt", True)])
def test_skeleton_holds_no_weights_and_materializes_the_same_model(family, tied):
    from _lm import tiny_lm

    from lalr_lightning.core.runtime.shards import materialize, skeleton

    model = tiny_lm(family, tied, hidden=32, layers=2)
    skel = skeleton(model)
    assert all(p.is_meta for p in skel.parameters())
    # the state dict leaves out non-persistent buffers (LLaMA's rotary frequencies): the skeleton keeps them
    kept = [n for n, b in skel.named_buffers() if not b.is_meta]
    assert family != "llama" or kept
    whole = materialize(skel, {k: v.clone() for k, v in model.state_dict().items()}, "cpu")
    names = lambda m: [n for n, _ in m.named_parameters()]  # noqa: E731 -- ties: one name per tied tensor
    assert names(whole) == names(model)
    if tied:
        assert whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    ids = torch.randint(4, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(whole(ids).logits, model(ids).logits, rtol=0, atol=0)
    frozen = materialize(skel, model.state_dict(), "cpu", frozen=True)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_a_module_that_cannot_be_copied_is_named_in_one_line():
    import threading

    from lalr_lightning.core.runtime.shards import WholeCopy

    model = nn.Sequential(nn.Linear(4, 4))
    model.lock = threading.Lock()  # deepcopy refuses it
    with pytest.raises(RuntimeError) as err:
        WholeCopy(model, "NTKDiagnostics")
    assert "keep objects that cannot be copied" in str(err.value) and "\n" not in str(err.value)
