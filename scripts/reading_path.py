"""What a reader follows to hold one module: the package modules it imports, transitively.

The measure, read from the source (nothing is imported or run): starting at a module, follow every
``import``/``from ... import`` of a ``lalr_lightning`` module that runs when the module is imported --
module-level statements, also inside a module-level ``try``/``if``, not under ``if TYPE_CHECKING`` and not
inside a function -- and repeat for each module reached. Packages' ``__init__`` files are followed
only where a statement names the package itself. Prints, for each start, how many modules lie behind it
(the start left out), the files read (the start included) and their lines, and with ``--list`` each file.

Usage::

    python scripts/reading_path.py                    # TempBalanceCallback's and HTSRPruning's modules
    python scripts/reading_path.py lalr_lightning.cli --list
    python scripts/reading_path.py --largest          # the package's largest modules
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lalr_lightning"
STARTS = ("lalr_lightning.callbacks.tempbalance", "lalr_lightning.callbacks.pruning")


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _resolve(module: str | None, level: int, here: str, is_package: bool) -> str:
    if not level:
        return module or ""
    parts = here.split(".")
    parts = parts if is_package else parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _module_level(body: list[ast.stmt]):
    """The import statements that run on import: top level, inside top-level try/if/with, not TYPE_CHECKING."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def imports_of(name: str) -> set[str]:
    """The package modules that ``name`` imports at module level."""
    path = module_file(name)
    if path is None:
        return set()
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve(node.module, node.level, name, is_package)
            # ``from pkg import mod`` names a module when pkg/mod.py exists, else a name of pkg
            targets = [f"{base}.{a.name}" if module_file(f"{base}.{a.name}") else base for a in node.names]
        for target in targets:
            if (target == PACKAGE or target.startswith(PACKAGE + ".")) and module_file(target):
                found.add(target)
    found.discard(name)
    return found


def behind(start: str) -> list[str]:
    """Every package module reached from ``start`` (itself left out), sorted."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in imports_of(todo.pop()):
            if name not in seen and name != start:
                seen.add(name)
                todo.append(name)
    return sorted(seen)


def lines(name: str) -> int:
    path = module_file(name)
    return len(path.read_text().splitlines()) if path else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("starts", nargs="*", default=list(STARTS), help="dotted module names")
    parser.add_argument("--list", action="store_true", help="list each file behind a start with its lines")
    parser.add_argument("--largest", type=int, nargs="?", const=5, metavar="N",
                        help="print the N largest modules of the package instead")
    args = parser.parse_args(argv)
    if args.largest:
        sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(ROOT).as_posix())
                        for p in (ROOT / PACKAGE).rglob("*.py")), reverse=True)
        for n, path in sizes[: args.largest]:
            print(f"{n:6d}  {path}")
        return
    for start in args.starts:
        if module_file(start) is None:
            parser.error(f"no module {start!r} under {ROOT}: give a dotted name such as {STARTS[0]}")
        mods = behind(start)
        total = lines(start) + sum(lines(m) for m in mods)
        print(f"{start}: {len(mods)} package modules behind it; {len(mods) + 1} files, {total} lines to read")
        if args.list:
            for name in [start, *mods]:
                print(f"  {lines(name):6d}  {module_file(name).relative_to(ROOT).as_posix()}")


if __name__ == "__main__":
    main()
