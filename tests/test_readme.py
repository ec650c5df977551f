"""Every Python block of README.md runs as written, in order, as one program (the later blocks
continue the quick start), on every backend, and so do the blocks of docs/custom-train-step.md (on
TensorFlow and torch): neither can drift from the code. The README stays short, and every relative
link of the README and the docs resolves, anchors included.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/test_readme.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: The custom ``train_step`` recipe's page; tests/test_model.py also runs its "## The recipe" block
#: against PerExampleModel. TensorFlow and torch only: JAX's train_step is stateless, as it says.
CUSTOM_TRAIN_STEP = ROOT / "docs" / "custom-train-step.md"

#: The README is the first page a user reads; details belong in docs/ (issue 38).
README_MAX_LINES = 200


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """``(section title, code)`` of every ```python block of a Markdown file, in order."""
    blocks, section = [], ""
    for part in re.split(r"(?m)^(## .*)$", path.read_text()):
        if part.startswith("## "):
            section = part
            continue
        blocks += [(section, code) for code in re.findall(r"```python\n(.*?)```", part, re.S)]
    return blocks


def run_as_one_program(path: Path) -> dict:
    """Runs every python block of ``path`` in order in one namespace; returns the namespace."""
    namespace = {}
    for title, code in python_blocks(path):
        exec(compile(code, f"{path.relative_to(ROOT)} ({title})", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_every_readme_block_runs_as_written():
    titles = [title for title, _ in python_blocks(README)]
    assert len(titles) >= 4, titles
    assert "## Quick start" in titles and "## Differential privacy (DP-SGD) in ten lines" in titles
    namespace = run_as_one_program(README)
    assert namespace["stats"].flat_norms.shape == (32,)


@pytest.mark.skipif(
    keras.backend.backend() == "jax",
    reason="JAX's Model.train_step(state, data) is stateless: the page's recipe is for TensorFlow and torch.",
)
def test_every_custom_train_step_block_runs_as_written():
    titles = [title for title, _ in python_blocks(CUSTOM_TRAIN_STEP)]
    assert titles == ["## Given a model and data", "## The recipe"], titles
    history = run_as_one_program(CUSTOM_TRAIN_STEP)["history"]
    assert set(history.history) == {"loss", "accuracy"}
    assert len(history.history["loss"]) == 5


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move details to docs/"


# --- links ------------------------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2``, ... for repeats."""
    anchors, seen = set(), {}
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    for heading in re.findall(r"(?m)^#{1,6}\s+(.*?)\s*#*\s*$", text):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_resolves():
    pages = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 50, checked
    assert not broken, "\n".join(broken)
