"""The 2:4 loader on the GPU (``oneshot.load_semi_structured``, ``--semi-structured``): a 2:4 checkpoint's
linear weights as semi-structured sparse tensors give the dense-with-zeros model's outputs within
float16 tolerance; a GPU below compute capability 8.0 is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from tests._lm import WORDS, save_tiny_lm
from tests.gpu._lane import ON_CUDA

pytestmark = pytest.mark.skipif(not ON_CUDA, reason="semi-structured sparse tensors need CUDA (not the CPU lane)")


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    from lalr_lightning.oneshot import prune_checkpoint

    root = tmp_path_factory.mktemp("sparse24")
    # shapes the sparse kernels take (multiples of 64 / 128): hidden 256, MLP 512
    model = save_tiny_lm(root / "dense", "llama", False, hidden=256, layers=2, heads=4, positions=128)
    rng = random.Random(0)
    words = [w for w in WORDS if w.isalpha()]
    (root / "calib.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(40)))
    prune_checkpoint(model, root / "24", criterion="wanda", n=2, m=4, calibration=root / "calib.txt", n_samples=8,
                     seq_len=64)
    return root / "24"


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def test_semi_structured_model_equals_the_dense_with_zeros(pruned):
    from transformers import AutoModelForCausalLM

    from lalr_lightning.oneshot import load_semi_structured

    if _capability() < (8, 0):
        pytest.skip("needs compute capability >= 8.0 (the refusal is tested below)")
    dense = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float16).to("cuda").eval()
    sparse, done = load_semi_structured(pruned, device="cuda", dtype="float16")
    assert set(done.values()) == {"sparse"} and len(done) == 2 * 7  # every linear of both blocks
    w = sparse.model.layers[0].mlp.down_proj.weight
    assert type(w).__name__.startswith("SparseSemiStructuredTensor")
    ids = torch.randint(4, 60, (3, 96), generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        a = dense(input_ids=ids, use_cache=False).logits.float()
        b = sparse(input_ids=ids, use_cache=False).logits.float()
    assert torch.isfinite(b).all()
    torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.99
    # a decode step (one token per sequence, a KV cache): the path text generation takes
    step = torch.randint(4, 60, (3, 1), generator=torch.Generator().manual_seed(1)).to("cuda")
    with torch.no_grad():
        cache_a = dense(input_ids=ids, use_cache=True).past_key_values
        cache_b = sparse(input_ids=ids, use_cache=True).past_key_values
        a1 = dense(input_ids=step, past_key_values=cache_a, use_cache=True).logits.float()
        b1 = sparse(input_ids=step, past_key_values=cache_b, use_cache=True).logits.float()
    torch.testing.assert_close(b1, a1, atol=2e-2, rtol=2e-2)


def test_below_compute_capability_8_is_one_line(pruned):
    from lalr_lightning.oneshot import load_semi_structured
    from lalr_lightning.oneshot.sparse24 import semi_structured_unsupported

    if _capability() >= (8, 0):
        assert semi_structured_unsupported("cuda") is None
        pytest.skip("this GPU supports 2:4 (the equality is tested above)")
    with pytest.raises(ValueError, match="compute capability 8.0") as info:
        load_semi_structured(pruned, device="cuda")
    assert "\n" not in str(info.value)
