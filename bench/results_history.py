"""One results file per benchmark, newest first: the latest run on top, the earlier ones below.

A benchmark hands its new Markdown to `write_markdown`; the run that was on top moves down into
the history (its headings one level deeper), unless it is the same run written again (the same
first line: a run that rewrites its file as it goes, or `--render` from the JSON). Notes kept by
hand below the marker stay where they are."""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- Earlier runs below, newest first (bench/results_history.py moves each run down here). -->"


def _demoted(block: str) -> str:
    """`block` as a history entry: every heading one level deeper, and a heading first."""
    lines = re.sub(r"(?m)^(#{1,5}) ", r"#\1 ", block).splitlines()
    if lines and not lines[0].startswith("#"):
        lines[0] = "## " + lines[0]
    return "\n".join(lines)


def write_markdown(path: Path, latest: str) -> None:
    """Writes `latest` on top of `path`, moving the run it replaces into the history below."""
    old = path.read_text() if path.exists() else ""
    old_latest, _, history = old.partition(MARKER)
    old_latest, history, latest = old_latest.strip(), history.strip(), latest.strip()
    first = latest.splitlines()[0] if latest else ""
    if old_latest and old_latest.splitlines()[0] != first:
        history = _demoted(old_latest) + ("\n\n" + history if history else "")
    text = latest + "\n"
    if history:
        text += f"\n{MARKER}\n\n{history}\n"
    path.write_text(text)
