"""How the package is laid out: what imports what.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/test_structure.py``.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

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
        "backend/_tensorflow_conv.py", "backend/_tensorflow_onednn.py", "backend/jax.py",
        "backend/tensorflow.py", "backend/torch.py",
    ]


def test_nothing_imports_keras_hub():
    """keras-hub's layers get their rules by dotted path: it stays optional."""
    pattern = re.compile(r"^\s*(import|from)\s+keras_hub\b|import_module\(\s*['\"]keras_hub", re.MULTILINE)
    assert [str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py") if pattern.search(p.read_text())] == []


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazily_imported(node) -> str | None:
    """The module ``importlib.import_module("a.b")`` or ``__import__("a.b")`` names with a
    literal string (``import_module(f"a.{name}")`` names no one module: not counted)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    argument = node.args[0]
    if name in ("import_module", "__import__") and isinstance(argument, ast.Constant) \
            and isinstance(argument.value, str):
        return argument.value
    return None


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of src/pergrad it imports``: at module level, inside functions
    (a PEP 562 module ``__getattr__`` included) and lazily, by ``importlib.import_module``
    with a literal name.

    ``from a import b`` counts as an import of ``a.b`` when that is a module, else of
    ``a``; relative imports are resolved. A package's ``__init__`` is a node of its own
    (importing ``a.b`` is not counted as importing ``a``).
    """
    files = {_module_name(path): path for path in SOURCE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            elif (literal := _lazily_imported(node)) is not None:
                targets = [literal]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    imported.add(target)
        graph[name] = imported
    return graph


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module, each as one cycle
    through some of its modules (``a -> b -> a``)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        start = min(component)
        # The shortest way back to `start` inside the component (breadth first).
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            following = sorted(graph[path[-1]] & component)
            if start in following:
                cycles.append(path + [start])
                break
            for other in following:
                if other not in seen:
                    seen.add(other)
                    paths.append(path + [other])
    return cycles


def test_the_import_graph_finds_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (package / "c.py").write_text("from pkg import a\n")
    (package / "d.py").write_text(  # PEP 562: lazy, by a literal name only
        "import importlib\ndef __getattr__(name):\n"
        "    return importlib.import_module('pkg.c'), importlib.import_module(f'pkg.{name}')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", package)
    graph = import_graph()
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_no_import_cycle_in_the_package():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_engine_and_the_replicas_ask_rules_instead_of_importing_them():
    """Path choice and replica policy come from what rules declare (``aggregators.base``)."""
    graph = import_graph()
    asking = [name for name in graph if name.startswith(("pergrad.engine", "pergrad.distributed"))]
    rules = ("pergrad.aggregators", "pergrad.privacy")
    concrete = {
        name: sorted(m for m in graph[name] if m.startswith(rules) and m != "pergrad.aggregators.base")
        for name in asking
    }
    # (the hand-off's fit check asks privacy's accountant check, as PerExampleModel.fit did)
    assert concrete == {name: [] for name in asking if name != "pergrad.distributed.training"} | {
        "pergrad.distributed.training": ["pergrad.privacy.callbacks"]
    }
    assert graph["pergrad.distributed.replicas"] <= {  # under the step: no engine path, no model
        "pergrad.aggregators.base", "pergrad.backend", "pergrad.distributed.layouts",
        "pergrad.distributed.processes", "pergrad.engine.collectives", "pergrad.tensors",
    }


#: The multi-device modules that code outside ``pergrad.distributed`` may import: the one
#: hand-off of the model, its trainers and its step, and the hosts' module that the
#: samplers and the DP key ask (no step logic: it is below them).
DISTRIBUTED_ENTRIES = {"pergrad.distributed.training", "pergrad.distributed.processes"}


def test_multi_device_code_is_reached_through_one_hand_off_and_never_by_the_engine():
    """The engine and the single-device step hold no replica logic: they call the methods of
    the one collectives object they are handed (``pergrad.engine.collectives``: the identity
    on one device), which ``pergrad.distributed`` subclasses. Nothing outside
    ``distributed/`` imports the replica module or the layouts, and the engine imports
    nothing from ``distributed/``."""
    graph = import_graph()
    outside = {name: sorted(m for m in imported if m.startswith("pergrad.distributed"))
               for name, imported in graph.items() if not name.startswith("pergrad.distributed")}
    assert {name: [m for m in found if m not in DISTRIBUTED_ENTRIES] for name, found in outside.items()} \
        == {name: [] for name in outside}
    engine = [name for name in outside if name.startswith("pergrad.engine")]
    assert engine and {name: outside[name] for name in engine} == {name: [] for name in engine}
    assert "pergrad.distributed.training" in graph["pergrad.training.step"]


def _replica_calls() -> list[str]:
    """``module: line`` of every call of a replica collective of the adapter (``replicas``,
    ``replica_id``, ``all_gather``, ``all_reduce_sum``) outside ``distributed/`` and
    ``backend/``."""
    names = {"replicas", "replica_id", "all_gather", "all_reduce_sum"}
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.relative_to(SOURCE).parts[0] in ("distributed", "backend"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in names:
                found.append(f"{_module_name(path)}: {node.lineno}")
    return found


def test_only_distributed_calls_the_adapters_replica_collectives():
    assert _replica_calls() == []


def test_rules_leave_every_collective_to_the_distributed_layer():
    """``aggregators/`` and ``privacy/`` return local quantities (sums, counts, a noise
    term): the engine, the step and the multi-device modules (every collective) are above
    them; the hosts' module (``processes``: the samplers' and the DP key's) is below. The one
    module of ``privacy/`` that is no rule, the audit (``canary_audit``), trains a model."""
    graph = import_graph()
    graph.pop("pergrad.privacy.canary_audit")
    above = ("pergrad.engine", "pergrad.training", "pergrad.distributed.replicas",
             "pergrad.distributed.layouts", "pergrad.distributed.training")
    rules = [name for name in graph if name.startswith(("pergrad.aggregators", "pergrad.privacy"))]
    assert rules
    assert {name: sorted(m for m in graph[name] if m.startswith(above)) for name in rules} == {
        name: [] for name in rules
    }


#: The module allowed to touch Keras's private names (``keras.src``, ``model._compile_loss``).
KERAS_PRIVATES = "compat"

#: ``module: expression`` -> why that underscore attribute, read off something other than
#: ``self`` or ``cls``, is allowed outside :data:`KERAS_PRIVATES`.
PRIVATE_ACCESS_ALLOWED = {
    "pergrad.engine.layers: other._materialized": "a copy of self in its class's own method",
    "pergrad.engine.layers: other._ghosts": "a copy of self in its class's own method",
    "pergrad.backend._tensorflow_onednn: pfor._pfor_converter_registry": (
        "TensorFlow's pfor converter registry, which TensorFlow does not export: TensorFlow's "
        "internals stay in the TensorFlow adapter's modules"
    ),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_used_across_modules() -> list[str]:
    """``module: name`` for every underscore name a module of src/pergrad reads off anything
    but itself: ``from pergrad.x import _name``, and every ``x._name`` (``getattr(x, "_name")``
    alike) where ``x`` is not ``self`` or ``cls``, a module, an object made in another module
    or Keras's. Dunders are not private; a package's own private modules
    (``backend._single_replica``) are its business; the one module of Keras's private names
    (:data:`KERAS_PRIVATES`) is exempt."""
    files = {_module_name(path): path for path in SOURCE.rglob("*.py")}
    exempt = f"{SOURCE.name}.{KERAS_PRIVATES}"
    found = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                if base not in files:
                    continue
                found.extend(f"{name}: {base}.{alias.name}" for alias in node.names
                             if f"{base}.{alias.name}" not in files and _private(alias.name))
            if name == exempt:
                continue
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner, attribute = node.value, node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                    and _private(node.args[1].value)):
                owner, attribute = node.args[0], node.args[1].value
            else:
                continue
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{name}: {ast.unparse(owner)}.{attribute}")
    return sorted(found)


def test_the_private_name_check_finds_imports_and_attributes(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text("")
    (package / "sub" / "_own.py").write_text("def _helper():\n    pass\n")
    (package / "sub" / "b.py").write_text("from pkg.sub import _own\nfrom pkg.a import public\n")
    (package / "a.py").write_text(
        "from pkg.sub._own import _helper, __doc__\nfrom pkg.sub import b\npublic = b._x\n"
        "class A:\n    def f(self, other):\n        self._own, other.__dict__\n"
        "        return other._step(), getattr(other.model, '_request'), hasattr(self, '_own')\n"
    )
    (package / "compat.py").write_text("def f(model):\n    return model._compile_loss\n")
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", package)
    assert _private_names_used_across_modules() == [
        "pkg.a: b._x", "pkg.a: other._step", "pkg.a: other.model._request", "pkg.a: pkg.sub._own._helper",
    ]


def test_no_module_uses_another_modules_private_names():
    """What modules share has a public name in the module that owns it; Keras's private
    names are read in one module (docs/architecture.md, 'Private Keras API')."""
    found = _private_names_used_across_modules()
    assert [f for f in found if f not in PRIVATE_ACCESS_ALLOWED] == []
    assert sorted(set(PRIVATE_ACCESS_ALLOWED) - set(found)) == []  # no stale entry


#: What some backend adapters define and others lack, outside ``OPTIONAL_KERNELS``: each is
#: reached only where its backend is known (``scan``: not on torch, whose ``EAGER_LOOPS``
#: :func:`pergrad.backend.eager` reads; ``PER_EXAMPLE_SEED_DRAWS``: the torch adapter's own).
PARTIAL_ADAPTER_NAMES = {"EAGER_LOOPS", "PER_EXAMPLE_SEED_DRAWS", "scan"}


def _adapter_names(name: str) -> set[str]:
    """The public names a backend adapter module defines or re-exports."""
    tree = ast.parse((SOURCE / "backend" / f"{name}.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pergrad.backend._"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def _kernel_probes() -> list[str]:
    """``module: line`` of every ``getattr`` / ``hasattr`` outside ``backend/`` whose object is
    ``adapter()`` or whose name is an optional kernel's, and of every
    ``optional_kernel(...)`` whose argument is not a declared kernel's name."""
    from pergrad.backend import OPTIONAL_KERNELS

    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.relative_to(SOURCE).parts[0] == "backend":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            args = node.args
            if node.func.id in ("getattr", "hasattr") and len(args) >= 2:
                on_adapter = isinstance(args[0], ast.Call) and (
                    getattr(args[0].func, "id", None) == "adapter"
                    or getattr(args[0].func, "attr", None) == "adapter")
                named = isinstance(args[1], ast.Constant) and args[1].value in OPTIONAL_KERNELS
                if on_adapter or named:
                    found.append(f"{_module_name(path)}: {node.lineno}")
            elif node.func.id == "optional_kernel" and not (
                    args and isinstance(args[0], ast.Constant) and args[0].value in OPTIONAL_KERNELS):
                found.append(f"{_module_name(path)}: {node.lineno}")
    return found


def test_optional_backend_kernels_are_declared_and_asked_for_through_one_function():
    """Code outside ``backend/`` asks for a kernel only some backends have with
    ``pergrad.backend.optional_kernel`` (a name of ``OPTIONAL_KERNELS``), never by probing
    the adapter (``getattr(adapter(), name, None)``); every name an adapter lacks is declared."""
    from pergrad.backend import OPTIONAL_KERNELS

    assert _kernel_probes() == []
    adapters = [_adapter_names(name) for name in ("tensorflow", "jax", "torch")]
    partial = set.union(*adapters) - set.intersection(*adapters)
    assert sorted(partial - set(OPTIONAL_KERNELS) - PARTIAL_ADAPTER_NAMES) == []
    assert sorted(set(OPTIONAL_KERNELS) - partial) == []  # each one some adapter lacks
    assert all(isinstance(doc, str) and "(" in doc for doc in OPTIONAL_KERNELS.values())


def test_the_probe_check_finds_probes(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "backend").mkdir(parents=True)
    (package / "backend" / "__init__.py").write_text("x = getattr(adapter(), 'fused', None)\n")
    (package / "a.py").write_text(
        "a = getattr(adapter(), 'anything', None)\n"
        "b = hasattr(backend.adapter(), 'x')\n"
        "c = getattr(other, 'noise_words', None)\n"
        "d = optional_kernel('not_a_kernel')\n"
        "e = optional_kernel('fused') or getattr(layer, 'kernel', None)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", package)
    assert _kernel_probes() == ["pkg.a: 1", "pkg.a: 2", "pkg.a: 3", "pkg.a: 4"]


#: The package's layers, lowest first: a module imports only from its own layer and the
#: layers below it (docs/architecture.md, 'The layout'). A name is a module or a package prefix.
LAYERS = (
    ("utilities", ("pergrad.tensors", "pergrad.log", "pergrad.compat", "pergrad.arguments",
                   "pergrad.layers")),
    ("backend adapters", ("pergrad.backend",)),
    ("processes", ("pergrad.distributed.processes",)),
    ("the rule protocol", ("pergrad.aggregators.base", "pergrad.aggregators.batch",
                           "pergrad.aggregators.row_map", "pergrad.aggregators.example_statistics",
                           "pergrad.aggregators.aggregation")),
    ("layer rules", ("pergrad.layer_rules",)),
    ("engine", ("pergrad.engine",)),
    ("rules", ("pergrad.aggregators", "pergrad.privacy")),
    ("several devices", ("pergrad.distributed",)),
    ("insight", ("pergrad.insight",)),
    ("training", ("pergrad.training",)),
    ("the public package", ("pergrad",)),
    ("applications", ("pergrad.apps",)),
)

#: ``importer -> imported`` arrows that run up a layer, each with its reason.
UPWARD_ALLOWED = {
    "pergrad.privacy.canary_audit -> pergrad.training.model": (
        "the audit is one DP training run of a PerExampleModel, and pergrad.privacy exports it"
    ),
}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest name that ``module`` is or is under."""
    best, found = -1, None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    assert found is not None, f"{module} is in no layer of LAYERS"
    return found


def upward_arrows(graph) -> list[str]:
    return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported
                  if layer_of(b) > layer_of(a))


def test_every_module_imports_only_its_layer_and_below():
    """``backend`` < the rule protocol < ``layer_rules`` < ``engine`` < the rules < ``distributed``
    < ``insight`` < ``training`` < ``pergrad`` < ``apps``: nothing in the library imports the
    applications, the engine asks rules what they declare (the protocol) instead of importing them,
    and the rules leave every collective to the layers above them."""
    found = upward_arrows(import_graph())
    assert [arrow for arrow in found if arrow not in UPWARD_ALLOWED] == []
    assert sorted(set(UPWARD_ALLOWED) - set(found)) == []  # no stale entry


def test_the_layer_check_finds_an_upward_arrow():
    graph = {"pergrad.engine.paths": {"pergrad.apps.demo", "pergrad.backend"},
             "pergrad.apps.demo": {"pergrad.training.model"}}
    assert upward_arrows(graph) == ["pergrad.engine.paths -> pergrad.apps.demo"]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("pergrad_cli")
