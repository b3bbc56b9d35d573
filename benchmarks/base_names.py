"""How much a method author has to hold: the public names the method base carries beyond
Lightning's ``Callback`` (issue 44's goal: at most 25), and what one attribute read of a method
costs against a plain object's.

    python benchmarks/base_names.py            # the count, the names, the attribute read
    python benchmarks/base_names.py --names    # the names only, one a line

An attribute read is timed as ``python -m timeit`` does (best of 5 rounds of 200,000 reads of
``scores`` on a fresh ``TempBalanceCallback``, and of an attribute of a plain object), so the two
numbers are comparable with the ``timeit`` one-liners of the issue.
"""

from __future__ import annotations

import argparse
import timeit

from lightning.pytorch.callbacks import Callback

from lalr_lightning.callbacks.base import LayerwiseCallback


def public_names(cls: type, beyond: type = Callback) -> list[str]:
    """The names without a leading underscore ``cls`` has that ``beyond`` lacks (a name that only
    raises ``AttributeError``, as the guard against ``transformers.Trainer``'s events, is none)."""
    return sorted(n for n in dir(cls) if not n.startswith("_") and not hasattr(beyond, n) and hasattr(cls, n))


def read_cost(obj: object, attr: str, number: int = 200_000) -> float:
    """Seconds per read of ``obj.attr``, the best of 5 rounds."""
    return min(timeit.repeat(f"o.{attr}", globals={"o": obj}, number=number, repeat=5)) / number


class _Plain:
    def __init__(self) -> None:
        self.scores: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", action="store_true", help="print the names only")
    args = parser.parse_args()
    names = public_names(LayerwiseCallback)
    if args.names:
        print("\n".join(names))
        return
    from lalr_lightning.callbacks import TempBalanceCallback

    print(f"LayerwiseCallback: {len(names)} public names beyond lightning's Callback")
    print("  " + ", ".join(names))
    method = read_cost(TempBalanceCallback(), "scores")
    plain = read_cost(_Plain(), "scores")
    print(f"attribute read: TempBalanceCallback().scores {method * 1e6:.3f} us, a plain object's {plain * 1e6:.3f} us")


if __name__ == "__main__":
    main()
