"""The method of docs/design.md's "Write your own callback", run as written there (so the page
and the tested code cannot drift apart); spawned workers import it from here."""

from __future__ import annotations

import re
from pathlib import Path

_DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"
SOURCE = re.search(r"<!-- own-method:start -->\s*```python\n(.*?)```\s*<!-- own-method:end -->",
                   _DOC.read_text(), re.S).group(1)
exec(compile(SOURCE, str(_DOC), "exec"), globals())  # noqa: S102 -- the page's own code
AlphaFreeze = globals()["AlphaFreeze"]
