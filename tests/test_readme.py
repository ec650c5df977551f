"""Every Python block of README.md runs as written, in order, as one program (the later blocks
continue the quick start), on every backend: the README cannot drift from the code.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/test_readme.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import keras

README = Path(__file__).resolve().parents[1] / "README.md"

#: The section whose block is run by tests/test_model.py against PerExampleModel (TensorFlow and
#: torch: JAX's train_step is stateless, as the README says).
OWN_TRAIN_STEP = "## Writing your own `train_step`"


def readme_blocks() -> list[tuple[str, str]]:
    """``(section title, code)`` of every ```python block, in order."""
    blocks, section = [], ""
    for part in re.split(r"(?m)^(## .*)$", README.read_text()):
        if part.startswith("## "):
            section = part
            continue
        blocks += [(section, code) for code in re.findall(r"```python\n(.*?)```", part, re.S)]
    return blocks


def test_every_readme_block_runs_as_written():
    blocks = readme_blocks()
    assert len(blocks) >= 5, [title for title, _ in blocks]
    namespace = {}
    ran = []
    for title, code in blocks:
        if title == OWN_TRAIN_STEP and keras.backend.backend() == "jax":
            continue
        exec(compile(code, f"README.md ({title})", "exec"), namespace)  # noqa: S102 - our own README
        ran.append(title)
    assert "## Quick start" in ran and "## Differential privacy (DP-SGD) in ten lines" in ran
    assert namespace["stats"].flat_norms.shape == (32,)
