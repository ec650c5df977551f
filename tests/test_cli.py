"""The ``pergrad`` command and the demo: a quiet, fast command line and a table printed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np

import pergrad_cli
from pergrad import aggregators

# Which modules the command imports for --help and --version (in a fresh interpreter).
from pergrad.apps import demo

_IMPORTED = """
import json, sys, contextlib, io
import pergrad_cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        pergrad_cli.main([sys.argv[1]])
    except SystemExit:
        pass
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"keras", "tensorflow", "jax", "torch", "pergrad"})
print(json.dumps({"heavy": heavy, "out": out.getvalue()}))
"""


def _run_fresh(argument: str) -> dict:
    env = dict(os.environ)
    source = os.path.dirname(os.path.abspath(pergrad_cli.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    completed = subprocess.run([sys.executable, "-c", _IMPORTED, argument], env=env, capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stderr == "", completed.stderr[-2000:]  # no backend's log lines
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_help_and_version_import_no_keras_nor_a_backend():
    shown = _run_fresh("--help")
    assert shown["heavy"] == [] and "demo" in shown["out"] and "insight" in shown["out"]
    version = _run_fresh("--version")
    assert version["heavy"] == [] and version["out"].startswith("pergrad ")


def test_every_option_has_help_and_no_text_has_backticks():
    parser = pergrad_cli.parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # (argparse's own)
    for name, command in [("pergrad", parser), *commands.items()]:
        assert "`" not in (command.description or ""), name
        for action in command._actions:
            if action.dest in ("help", "command"):
                continue
            assert action.help and "`" not in action.help, (name, action.dest)


def test_the_demo_prints_its_table_once_and_names_files_by_backend(tmp_path):
    lines = []
    rows = demo.run(rules=[("mean", aggregators.mean)], seeds=2, epochs=1, out_dir=str(tmp_path), dp=False,
                    echo=lines.append)
    backend = keras.backend.backend()
    assert lines.count(demo.TABLE_HEADER[0]) == 1
    for row in rows:
        printed = [line for line in lines if line.startswith(f"| {row.rule} |")]
        assert printed == [demo.table_row(row)] and " ± " in printed[0]
        assert [len(row.accuracy[name]) for name in ("clean", "corrupted")] == [2, 2]
    written = (tmp_path / f"results_{backend}.md").read_text()
    table = list(demo.TABLE_HEADER) + [demo.table_row(row) for row in rows]
    assert written.splitlines()[: len(table)] == table
    assert (tmp_path / f"learning_curves_{backend}.png").stat().st_size > 10_000


def test_each_run_of_a_row_starts_from_its_seed_alone():
    """A row reuses one model (one compilation): the weights, the optimizer's and the rule's
    state (centered clipping's center) are set back, so every run of a seed is the same run.
    (Not the first: Keras's first fit() draws one more shuffling permutation from NumPy's
    global generator when it builds the step.)"""
    row = demo.train_rule("centered_clip", aggregators.centered_clip(1.0), [1, 1, 1], 1, 64, 0.2)
    for name in ("clean", "corrupted"):
        np.testing.assert_array_equal(row.curves[name][1], row.curves[name][2])
