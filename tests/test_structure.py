"""How the package is laid out: what imports what.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/test_structure.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pergrad
import problems
from pergrad import privacy

SOURCE = pathlib.Path(pergrad.__file__).parent

# Run in a fresh interpreter: sys.modules before and after, then the lazy names.
_FRESH = """
import json, sys
import keras
import pergrad.aggregators
report = {"privacy_imported": "pergrad.privacy" in sys.modules}
loaded = keras.models.load_model(sys.argv[1])
report["loaded_aggregator"] = type(loaded.aggregator).__name__
from pergrad import aggregators, privacy
report["lazy_names"] = [
    aggregators.dp_gaussian is privacy.dp_gaussian, aggregators.DPGaussian is privacy.DPGaussian
]
print(json.dumps(report))
"""


def test_aggregators_do_not_import_privacy_and_dp_models_load(tmp_path):
    # pergrad.privacy.dp_sgd builds on pergrad.aggregators.base: importing privacy from
    # aggregators/__init__ made the two packages import each other.
    problem = problems.dense_mlp()
    model = pergrad.PerExampleModel(problem.model, privacy.dp_gaussian(1.0, 1.0))
    problem.compile(model)
    path = tmp_path / "dp.keras"
    model.save(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE.parent), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-c", _FRESH, str(path)], env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report == {
        "privacy_imported": False,
        "loaded_aggregator": "DPGaussian",  # registered for keras.saving on load
        "lazy_names": [True, True],  # pergrad.aggregators.dp_gaussian still works
    }


def test_only_the_backend_adapters_import_a_backend():
    pattern = re.compile(r"^\s*(import|from)\s+(tensorflow|jax|jaxlib|torch)\b", re.MULTILINE)
    importing = sorted(
        str(path.relative_to(SOURCE))
        for path in SOURCE.rglob("*.py")
        if pattern.search(path.read_text())
    )
    assert importing == [
        "backend/_tensorflow_onednn.py", "backend/jax.py", "backend/tensorflow.py", "backend/torch.py"
    ]


def test_nothing_imports_keras_hub():
    """keras-hub's layers get their rules by dotted path: it stays optional."""
    pattern = re.compile(r"^\s*(import|from)\s+keras_hub\b|import_module\(\s*['\"]keras_hub", re.MULTILINE)
    assert [str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py") if pattern.search(p.read_text())] == []
