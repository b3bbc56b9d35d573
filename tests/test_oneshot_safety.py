"""``prune --out`` into a symbolic link, and ``prune --in-memory`` on a full disk (issue 42, rows 5
and 6): the work lands in the link's target, and a full disk is one line, as on the streamed path."""

from __future__ import annotations

import random

import pytest

from lalr_lightning.oneshot.outdir import OutputClaim
from tests._lm import save_tiny_lm
from tests.test_oneshot import _WORDS, _run
from tests.test_oneshot_hostile import _args, _no_trace_of, _one_line_error


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    rng = random.Random(0)
    (root / "calib.txt").write_text(" ".join(rng.choice(_WORDS) for _ in range(3000)))
    return root, save_tiny_lm(root / "llama", "llama", False)


@pytest.mark.parametrize("target_exists", [True, False], ids=["to_an_empty_dir", "dangling"])
def test_output_claim_through_a_symlink_writes_into_its_target(tmp_path, target_exists):
    target = tmp_path / "real" / "out"
    if target_exists:
        target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    claim = OutputClaim(link)
    with claim as tmp:
        assert tmp.parent == target.parent  # the temporary sibling sits next to the target: the rename lands
        (tmp / "model.safetensors").write_text("x")
        claim.commit()
    assert link.is_symlink() and (link / "model.safetensors").read_text() == "x"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]  # no lock or partial left


def test_prune_out_a_dangling_link_writes_the_model_there(llama, tmp_path, capsys):
    root, model = llama
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    code, out, err = _run(_args(root, model, link), capsys)
    assert code == 0, err
    assert link.is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert list((tmp_path / "target").glob("*.safetensors"))


def test_prune_in_memory_on_a_full_disk_is_one_line_and_leaves_nothing(llama, tmp_path, capsys, monkeypatch):
    """transformers' save_pretrained on a full disk: safetensors raises its own error (not an
    OSError), which was a 23-line traceback."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    root, model = llama

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    code, _, err = _run(_args(root, model, out, "--in-memory"), capsys)
    _one_line_error(code, err, "No space left on device", "nothing was written to --out", "cannot write")
    _no_trace_of(out)
