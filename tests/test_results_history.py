"""bench/results_history.py: one results file per benchmark, newest run first, notes kept."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import results_history  # noqa: E402


def test_runs_stack_newest_first_and_notes_stay_below(tmp_path):
    path = tmp_path / "real.md"
    results_history.write_markdown(path, "# Run, 10:00\n\n| a |\n|---|\n| 1 |\n")
    assert results_history.MARKER not in path.read_text()  # nothing earlier yet

    # Notes written by hand below the marker stay at the bottom.
    path.write_text(path.read_text() + f"\n{results_history.MARKER}\n\n## Notes\n\nby hand\n")
    results_history.write_markdown(path, "# Run, 11:00\n\n## Detail\n\n| a |\n|---|\n| 2 |\n")
    results_history.write_markdown(path, "# Run, 12:00\n\n| a |\n|---|\n| 3 |\n")
    text = path.read_text()
    latest, history = text.split(results_history.MARKER)
    assert latest.startswith("# Run, 12:00") and "| 3 |" in latest and "| 2 |" not in latest
    # Earlier runs newest first, their headings one level deeper, then the notes.
    order = [history.index(s) for s in ("## Run, 11:00", "### Detail", "## Run, 10:00", "## Notes")]
    assert order == sorted(order), history
    assert history.count("| 2 |") == 1 and history.count("| 1 |") == 1


def test_the_same_run_written_again_replaces_itself(tmp_path):
    # bench_real.py rewrites its file after every case; bench_zoo.py --render from the JSON.
    path = tmp_path / "zoo.md"
    results_history.write_markdown(path, "# Zoo, 10:00\n\n| gpt2 |\n")
    results_history.write_markdown(path, "# Zoo, 10:00\n\n| gpt2 |\n| llama |\n")
    text = path.read_text()
    assert text.count("# Zoo, 10:00") == 1 and "| llama |" in text
    assert results_history.MARKER not in text


def test_a_first_line_that_is_not_a_heading_becomes_one(tmp_path):
    # bench_models.py's latest.md starts with a line of run information.
    path = tmp_path / "latest.md"
    results_history.write_markdown(path, "tpuc benchmark, 10:00\n\n| mlp |\n")
    results_history.write_markdown(path, "tpuc benchmark, 11:00\n\n| mlp |\n")
    history = path.read_text().split(results_history.MARKER)[1]
    assert "\n## tpuc benchmark, 10:00\n" in history
