"""MkDocs hook: the per-engine hop table, generated from the code (`dad_integrations.routes.hop_table`).

A page's blocks between ``<!-- hop-table:engines -->`` (or ``:hops``) and ``<!-- /hop-table -->``
are rendered anew from the layouts each engine declares (`routes.layouts.ENGINES`) and the route
registry, so the site cannot show a stale table; ``tests/test_hop_table.py`` keeps the committed
blocks (what GitHub shows) equal to the render too.
"""
from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- hop-table:" not in markdown:
        return markdown
    from dad_integrations.routes.hop_table import update  # the build fails if the package does not import
    return update(markdown)
