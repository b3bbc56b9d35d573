"""mkdocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

* The docstrings are written with Sphinx roles (``:func:`~lalr_lightning.core.x.f```) and
  reStructuredText's ``Example::``; mkdocstrings renders Markdown, which shows those as text.
  :func:`on_page_content` turns each role into a cross-reference (mkdocs-autorefs resolves it to
  the object's entry where the reference documents it, and leaves plain code elsewhere) and ``::``
  at a paragraph's end into ``:``.
* The user-facing Callbacks page lists the callbacks with what a user calls or reads
  (:func:`on_page_markdown`): the timeline steps a method implements (``measure``, ``decide``,
  ``after_wrap``, ...), defined by the base classes, are the page "Writing your own callback"'s.
"""

from __future__ import annotations

import html
import re

#: the marker in docs/api/callbacks.md that the callbacks' directive replaces
MARKER = "<!-- the callbacks, with what a user calls or reads: scripts/mkdocs_hooks.py -->"
#: members of the base classes that a user of a callback calls or reads (the rest are the steps)
USER_FACING = ("plan", "selected_blocks", "multipliers", "settings")

_ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|attr|data|obj|exc):<code>(~?)([\w.]+)</code>")


def extension_api() -> tuple[list[str], set[str]]:
    """(the base classes a new method derives from, the names they define that a user of a
    finished callback neither calls nor reads)."""
    import lalr_lightning.callbacks as cbs

    bases = [cbs.LayerwiseCallback, cbs.LayerSelection, cbs.Decision]
    names: set[str] = set()
    for cls in (cbs.LayerwiseCallback, cbs.LayerSelection):
        for klass in cls.__mro__:
            if klass.__module__.startswith("lalr_lightning."):
                names |= {n for n in vars(klass) if not n.startswith("_")}
    return [b.__name__ for b in bases], names - set(USER_FACING)


def callbacks_directive() -> str:
    """The mkdocstrings directive of the Callbacks page: every name of ``lalr_lightning.callbacks``
    but the base classes, without the base classes' steps."""
    import lalr_lightning.callbacks as cbs

    bases, steps = extension_api()
    members = [n for n in cbs.__all__ if n not in bases]
    filters = ['"!^_[^_]"'] + [f'"!^{n}$"' for n in sorted(steps)]
    return ("::: lalr_lightning.callbacks\n    options:\n      members:\n"
            + "".join(f"        - {n}\n" for n in members)
            + "      filters:\n" + "".join(f"        - {f}\n" for f in filters))


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, callbacks_directive())
    return markdown


def _reference(match: re.Match) -> str:
    _, short, target = match.groups()
    shown = target.rpartition(".")[2] if short else target.lstrip(".")
    code = f"<code>{html.escape(shown)}</code>"
    if target.startswith("."):  # relative to the module it is written in: shown, not linked
        return code
    return f'<autoref identifier="{html.escape(target)}" optional>{code}</autoref>'


def on_page_content(content: str, page, **kwargs) -> str:
    content = _ROLE.sub(_reference, content)
    return re.sub(r"::(\s*</p>)", r":\1", content)
