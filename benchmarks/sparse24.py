"""2:4 semi-structured sparse tensors against the dense-with-zeros model: prefill tokens/s and one decode step.

A LLaMA-shaped model (random init; default hidden 2048, MLP 5632, 4 blocks, float16) gets the 2:4
pattern on every linear weight of its blocks (the two smallest |w| of every four inputs set to zero,
what ``prune --n 2 --m 4 --criterion magnitude`` writes). The same weights then run twice, dense with
zeros and after :func:`lalr_lightning.oneshot.sparse24.to_semi_structured`:

* prefill: ``--batch`` sequences of ``--seq-len`` tokens, tokens per second (CUDA-event timed, the
  median of ``--repeat`` runs after warm-up);
* decode: one new token per sequence with a KV cache of ``--seq-len`` tokens, milliseconds per step;

and the largest difference of the logits. On a CPU, or a GPU below compute capability 8.0, it says so in
one line and exits (nothing to compare: the 2:4 model runs dense there). Usage::

    python benchmarks/sparse24.py                                  # on a GPU of compute capability >= 8.0
    python benchmarks/sparse24.py --hidden 4096 --intermediate 11008 --layers 2   # LLaMA-7B-shaped blocks
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` on the GPU (three warm-up calls)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lalr_lightning.core.pruning.calibration import decoder_blocks

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=args.hidden // 128, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    _, blocks = decoder_blocks(model)
    with torch.no_grad():
        for block in blocks:
            for mod in block.modules():
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight
                    groups = w.reshape(-1, 4)
                    drop = groups.abs().argsort(dim=1)[:, :2]  # the two smallest of every four inputs
                    groups.scatter_(1, drop, 0.0)
    return model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    from lalr_lightning.oneshot.sparse24 import semi_structured_unsupported, to_semi_structured

    why = semi_structured_unsupported("cuda")
    if why:
        print(f"sparse24: {why}; nothing to measure here")
        return
    dense = _model(args)
    sparse = copy.deepcopy(dense)
    done = to_semi_structured(sparse)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device="cuda")
    step = torch.randint(0, args.vocab, (args.batch, 1), device="cuda")
    rows = {}
    with torch.no_grad():
        for name, model in (("dense", dense), ("2:4", sparse)):
            prefill = _timed(lambda m=model: m(input_ids=ids, use_cache=False), args.repeat)
            cache = model(input_ids=ids, use_cache=True).past_key_values

            def decode(m=model, c=cache):
                m(input_ids=step, past_key_values=copy.copy(c), use_cache=True)

            rows[name] = (args.batch * args.seq_len / prefill, _timed(decode, args.repeat) * 1000)
        diff = float((dense(input_ids=ids[:1], use_cache=False).logits.float()
                      - sparse(input_ids=ids[:1], use_cache=False).logits.float()).abs().max())
    gpu = torch.cuda.get_device_name(0)
    print(f"{gpu}, torch {torch.__version__}: hidden {args.hidden}, MLP {args.intermediate}, {args.layers} blocks, "
          f"float16, batch {args.batch} x {args.seq_len}; {sum(v == 'sparse' for v in done.values())} of "
          f"{len(done)} linear weights semi-structured")
    print(f"{'':8} {'prefill tokens/s':>17} {'decode ms/step':>15}")
    for name, (tps, ms) in rows.items():
        print(f"{name:8} {tps:17.0f} {ms:15.3f}")
    print(f"{'2:4/dense':8} {rows['2:4'][0] / rows['dense'][0]:16.2f}x {rows['dense'][1] / rows['2:4'][1]:14.2f}x  "
          f"(speed-up; logits differ by at most {diff:.3g})")


if __name__ == "__main__":
    main()
