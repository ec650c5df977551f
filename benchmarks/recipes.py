"""The variants a benchmark row times: the plain step, pergrad, the usual hand-written recipes.

A variant is ``"<recipe> <aggregation>"`` (or ``plain``):

- ``plain``: the Keras model itself (``model.compile`` + Keras's step);
- ``jacobian <agg>``: a custom ``train_step`` that takes the Jacobian of the
  unreduced per-example loss vector w.r.t. the trainable variables, then
  aggregates: TF ``tape.jacobian`` (pfor), JAX ``jax.jacrev`` through
  ``stateless_call``, torch ``torch.func.jacrev`` through ``stateless_call``;
- ``vmap <agg>``: a custom ``train_step`` vectorizing the single-example
  gradient: TF a hand-written ``tf.vectorized_map`` around a ``GradientTape``,
  JAX ``jax.vmap(jax.grad)`` through ``stateless_call``, torch
  ``torch.func.vmap(torch.func.grad)`` through ``stateless_call``;
- ``pergrad <agg>``: ``pergrad.PerExampleModel(model, agg)``, its default path
  (``path="auto"`` where the checkout's ``PerExampleModel`` has ``path=``);
- ``pergrad-mat <agg>``: ``PerExampleModel(..., path="materialized")``, the
  materialized (vmap) engine beside the default path; ``pergrad-stats <agg>``
  forces ``path="statistics"``. Only where ``path=`` exists (checked with
  ``inspect.signature``);
- ``opacus-plain`` and ``opacus clip`` (torch, if ``opacus`` imports; MLP and
  CNN only): the same MLP / CNN written in ``torch.nn`` (NCHW), trained by a
  plain torch loop, and made private by Opacus ghost clipping
  (``PrivacyEngine().make_private(..., grad_sample_mode="ghost",
  noise_multiplier=0, max_grad_norm=1.0, poisson_sampling=False)``, the
  returned ``DPLossFastGradientClipping`` criterion: two backward passes);
- ``tf-privacy-plain``, ``tf-privacy clip|dp`` (TensorFlow) and ``jax-privacy
  clip|dp``, ``jax-privacy-mb1 clip|dp`` (JAX): ``benchmarks/peers.py``.

Aggregations: ``mean``; ``median`` (coordinate-wise); ``clip`` = per-example
flat L2 clipping to 1.0 then the mean (``pergrad.aggregators.clip(1.0)``);
``dp`` = ``pergrad.privacy.dp_gaussian(1.0, 1.0)`` (clip to 1.0, sum, Gaussian
noise of std 1.0, divide by B); ``krum`` = ``krum(0.1)``; ``geomed`` =
``geometric_median()``; ``normfilter`` = ``norm_filter()`` (drops norms above 3x
the median); the coordinate rules ``trimmed`` = ``trimmed_mean(0.1)``,
``meamed`` = ``meamed(0.1)``, ``signs`` = ``sign_majority()``, ``bucketmedian``
= ``bucketing(8, median())``, ``clipmedian`` = ``chain(clip(1.0), median())``.
The jacobian and vmap recipes aggregate mean, median and clip with hand-written
``keras.ops`` code doing the same thing; the other aggregations are
pergrad-only. A variant that does not apply raises :class:`runner.Skipped`
(a "skipped: why" row).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings

import keras
from keras import ops

import peers
import pergrad
from models import (
    BUCKET_SIZE,
    CLIP_NORM,
    CONV_KINDS,
    HUB_KINDS,
    KRUM_BYZANTINE,
    LEARNING_RATE,
    LM_KINDS,
    NOISE_MULTIPLIER,
    RNN_KINDS,
    SEED,
    TRIM,
    build_model,
    example_losses,
    new_loss,
    new_optimizer,
    parse_model,
)
from runner import Skipped, Stepper, Steps

BACKEND = keras.backend.backend()

#: aggregations of the rows; the recipes implement only RECIPE_AGGREGATE's
AGGREGATIONS = ("mean", "median", "clip", "dp", "krum", "geomed", "normfilter", "trimmed",
                "meamed", "signs", "bucketmedian", "clipmedian")
#: the default ``--aggregations`` (the default suite's rows)
DEFAULT_AGGREGATIONS = ("mean", "median", "clip", "dp", "krum", "geomed", "normfilter")
#: the statistics rules: the ones with a fast path, shown again as ``pergrad-mat``
STATISTICS_AGGREGATIONS = ("mean", "clip", "dp", "krum", "geomed", "normfilter")
#: the coordinate rules (and the compositions ending in one)
COORDINATE_AGGREGATIONS = ("median", "trimmed", "meamed", "signs", "bucketmedian", "clipmedian")

#: ``--quick``'s rows
QUICK_VARIANTS = ("plain", "vmap clip", "pergrad median", "pergrad clip", "pergrad krum")
QUICK_OPACUS = ("opacus clip", "opacus-plain")
#: ``--suite lm``'s rows, and the recurrent models' (``--suite rnn``)
LM_VARIANTS = ("plain", "pergrad mean", "pergrad clip", "pergrad dp", "pergrad-mat clip")
#: the convolution models' rows (``--suite conv``)
CONV_VARIANTS = ("plain", "pergrad clip", "pergrad dp", "pergrad-mat clip")
#: the largest MLP batch with a ``jacobian median`` row in ``--suite coordinate``: that row
#: took 0.6-1.6 s per step on mlp64 and 4.4-9.3 s on mlp256 (2-core machine)
COORDINATE_JACOBIAN_MLP_BATCH = 64
#: ``--suite coordinate --memory``: the variants measured for memory (plus plain)
COORDINATE_MEMORY_VARIANTS = ("plain", "pergrad-mat median", "pergrad median")

#: whether this checkout's PerExampleModel can be told which engine path to take
HAS_PATH = "path" in inspect.signature(pergrad.PerExampleModel.__init__).parameters
#: the engine path of each pergrad recipe
PERGRAD_PATHS = {"pergrad": "auto", "pergrad-mat": "materialized", "pergrad-stats": "statistics"}
#: recipes whose train step aggregates with RECIPE_AGGREGATE (hand-written keras.ops)
HAND_AGGREGATED = ("jacobian", "vmap")
#: the Opacus anchor: torch-native equivalents of these model kinds only
OPACUS_KINDS = ("mlp", "cnn")

# --------------------------------------------------------------------------------------
# the aggregations: written by hand in keras.ops for the recipes, pergrad's for pergrad


def aggregate_mean(grads):
    return [ops.mean(g, axis=0) for g in grads]


def aggregate_median(grads):
    return [ops.median(g, axis=0) for g in grads]


def aggregate_clip(grads, l2_norm=CLIP_NORM):
    batch = ops.shape(grads[0])[0]
    flat = [ops.reshape(g, (batch, -1)) for g in grads]
    norms = ops.sqrt(sum(ops.sum(f * f, axis=1) for f in flat))
    weights = (l2_norm / ops.maximum(norms, l2_norm)) / ops.cast(batch, norms.dtype)
    return [
        ops.reshape(ops.matmul(weights[None, :], f)[0], g.shape[1:]) for f, g in zip(flat, grads)
    ]


RECIPE_AGGREGATE = {"mean": aggregate_mean, "median": aggregate_median, "clip": aggregate_clip}


def pergrad_aggregator(name):
    """The pergrad aggregator of a row's aggregation name."""
    aggregators = pergrad.aggregators
    if name == "clip":
        return aggregators.clip(CLIP_NORM)
    if name == "dp":
        return pergrad.privacy.dp_gaussian(CLIP_NORM, NOISE_MULTIPLIER)
    if name == "krum":
        return aggregators.krum(KRUM_BYZANTINE)
    if name == "geomed":
        return aggregators.geometric_median()
    if name == "normfilter":
        return aggregators.norm_filter()  # factor=3 x the median norm
    if name == "trimmed":
        return aggregators.trimmed_mean(TRIM)
    if name == "meamed":
        return aggregators.meamed(TRIM)
    if name == "signs":
        return aggregators.sign_majority()
    if name == "bucketmedian":
        return aggregators.bucketing(BUCKET_SIZE, aggregators.median())
    if name == "clipmedian":
        return aggregators.chain(aggregators.clip(CLIP_NORM), aggregators.median())
    return name


def describe_aggregations() -> str:
    """The header's line on what each aggregation name builds."""
    return (f"Aggregations: clip = clip({CLIP_NORM:g}); dp = privacy.dp_gaussian({CLIP_NORM:g}, "
            f"{NOISE_MULTIPLIER:g}); krum = krum({KRUM_BYZANTINE:g}); geomed = geometric_median(); "
            "normfilter = norm_filter() (factor 3); "
            f"trimmed = trimmed_mean({TRIM:g}); meamed = meamed({TRIM:g}); signs = sign_majority(); "
            f"bucketmedian = bucketing({BUCKET_SIZE}, median()); clipmedian = "
            f"chain(clip({CLIP_NORM:g}), median()).")


# --------------------------------------------------------------------------------------
# the hand-written recipes: custom train steps, one per backend


class RecipeModel(keras.Model):
    """Wraps ``inner``; ``train_step`` computes per-example gradients by ``recipe``."""

    def __init__(self, inner, recipe: str, aggregation: str, kind: str = "mlp", **kwargs):
        super().__init__(name=f"{recipe}_{aggregation}", **kwargs)
        self.inner = inner
        self.recipe = recipe
        self.kind = kind
        self.aggregate = RECIPE_AGGREGATE[aggregation]
        self.built = True

    def call(self, x, training=None):
        return self.inner(x, training=training)


opacus = None  # torch only, imported below

if BACKEND == "tensorflow":
    import tensorflow as tf

    class Recipe(RecipeModel):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            variables = self.inner.trainable_variables
            if self.recipe == "jacobian":
                with tf.GradientTape() as tape:
                    losses = example_losses(y, self.inner(x, training=True), self.kind)
                grads = tape.jacobian(losses, variables)
            else:

                def single(example):
                    xi, yi = example
                    with tf.GradientTape() as tape:
                        loss = example_losses(yi[None], self.inner(xi[None], training=True), self.kind)[0]
                    return tape.gradient(loss, variables)

                grads = tf.vectorized_map(single, (x, y))
            self.optimizer.apply(self.aggregate(grads), variables)
            return {}

elif BACKEND == "jax":
    import jax

    class Recipe(RecipeModel):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            inner = self.inner

            if self.recipe == "jacobian":

                def losses(values):
                    logits, _ = inner.stateless_call(values, non_trainable, x, training=True)
                    return example_losses(y, logits, self.kind)

                grads = jax.jacrev(losses)(trainable)
            else:

                def loss(values, xi, yi):
                    logits, _ = inner.stateless_call(values, non_trainable, xi[None], training=True)
                    return example_losses(yi[None], logits, self.kind)[0]

                grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(trainable, x, y)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, self.aggregate(grads), trainable
            )
            return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)

else:
    import torch

    try:  # the optional Opacus anchor (pip install opacus)
        import opacus
    except ImportError:
        opacus = None

    class Recipe(RecipeModel):
        #: set when the raw torch.vmap recipe needed pergrad's keras#23587 workaround
        needed_layout_workaround = False

        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            inner = self.inner
            variables = inner.trainable_variables
            values = [v.value for v in variables]
            non_trainable = [v.value for v in inner.non_trainable_variables]

            if self.recipe == "jacobian":

                def losses(values):
                    logits, _ = inner.stateless_call(values, non_trainable, x, training=True)
                    return example_losses(y, logits, self.kind)

                with torch.enable_grad():
                    grads = torch.func.jacrev(losses)(values)
            else:

                def loss(values, xi, yi):
                    logits, _ = inner.stateless_call(values, non_trainable, xi[None], training=True)
                    return example_losses(yi[None], logits, self.kind)[0]

                vectorized = torch.func.vmap(
                    torch.func.grad(loss), in_dims=(None, 0, 0), randomness="different"
                )
                with torch.enable_grad(), self._layout_context():
                    try:
                        grads = vectorized(values, x, y)
                    except RuntimeError as error:
                        if "NYI" not in str(error) or Recipe.needed_layout_workaround:
                            raise
                        Recipe.needed_layout_workaround = True
                        with self._layout_context():
                            grads = vectorized(values, x, y)
            with torch.no_grad():
                self.optimizer.apply(self.aggregate(grads), variables)
            return {}

        @staticmethod
        def _layout_context():
            if not Recipe.needed_layout_workaround:
                return contextlib.nullcontext()
            from pergrad.backend.torch import _VmapWorkarounds  # answers vmap's layout requests

            return _VmapWorkarounds()


def describe_recipes() -> str:
    return {
        "tensorflow": "jacobian = tape.jacobian (pfor) of the loss vector; vmap = hand-written "
        "tf.vectorized_map of a GradientTape per example",
        "jax": "jacobian = jax.jacrev of the loss vector through stateless_call; "
        "vmap = jax.vmap(jax.grad) through stateless_call",
        "torch": "jacobian = torch.func.jacrev of the loss vector through stateless_call; "
        "vmap = torch.func.vmap(torch.func.grad) through stateless_call",
    }[BACKEND]


# --------------------------------------------------------------------------------------
# the Opacus anchor (torch)


class TorchStepper(Steps):
    """The Opacus anchor: a torch-native model, trained by a plain torch loop
    (``opacus-plain``) or made private with Opacus ghost clipping (``opacus clip``:
    ``grad_sample_mode="ghost"``, flat clipping to ``CLIP_NORM``, noise 0, mean
    loss reduction, the fixed batch instead of Poisson sampling)."""

    def __init__(self, kind, x, y, private: bool):
        torch.manual_seed(SEED)
        nn = torch.nn
        if kind == "mlp":
            net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                nn.Linear(256, 10))
        else:  # NCHW: Conv 3x3x16 relu, Conv 3x3x32 relu, MaxPool 2, Flatten, Dense 10
            net = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                                nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 12 * 12, 10))
            x = x.permute(0, 3, 1, 2).contiguous()
        self.x, self.y = x.detach(), y.detach().long()
        optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
        criterion = nn.CrossEntropyLoss()
        if private:
            loader = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(self.x, self.y), batch_size=len(self.x)
            )
            net, optimizer, criterion, _ = opacus.PrivacyEngine(accountant="rdp").make_private(
                module=net, optimizer=optimizer, criterion=criterion, data_loader=loader,
                noise_multiplier=0.0, max_grad_norm=CLIP_NORM, poisson_sampling=False,
                grad_sample_mode="ghost",
            )
        net.train()
        # Opacus's hooks on the first layer (whose input needs no gradient): harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.net, self.optimizer, self.criterion = net, optimizer, criterion
        start = time.perf_counter()
        self.steps(1)
        self.first_step_s = time.perf_counter() - start

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.criterion(self.net(self.x), self.y)
            loss.backward()  # Opacus ghost: two backward passes (norms, then clipped sum)
            self.optimizer.step()


def describe_opacus() -> str:
    """The header's line on the Opacus rows (torch run)."""
    if opacus is None:
        return "Opacus: not installed (no Opacus rows)."
    return (f"Opacus: opacus {opacus.__version__}, torch-native MLP/CNN: opacus-plain = a plain torch "
            "loop; opacus clip = make_private(grad_sample_mode=\"ghost\", noise_multiplier=0, "
            f"max_grad_norm={CLIP_NORM:g}, poisson_sampling=False); its x plain is against the "
            "Keras plain step (the ratios under the table also give it against opacus-plain).")


# --------------------------------------------------------------------------------------
# the variants of a row


def split_variant(name: str) -> tuple[str, str]:
    """``"pergrad clip"`` -> ``("pergrad", "clip")``; ``"plain"`` -> ``("plain", "")``."""
    recipe, _, aggregation = name.partition(" ")
    return recipe, aggregation


def unsupported(name: str, kind: str) -> str | None:
    """Why variant ``name`` cannot run on a ``kind`` model here, or None."""
    recipe, aggregation = split_variant(name)
    if recipe in peers.RECIPES and kind in RNN_KINDS:
        return "no peer twin of the recurrent models"
    if recipe in peers.RECIPES:
        return peers.unsupported(recipe, aggregation, BACKEND)
    if recipe in ("opacus", "opacus-plain"):
        if BACKEND != "torch":
            return "Opacus rows run in the torch run only"
        if opacus is None:
            return "opacus not installed"
        if kind not in OPACUS_KINDS:
            return f"no torch-native {kind} model for Opacus (MLP and CNN only)"
        if recipe == "opacus" and aggregation != "clip":
            return "Opacus rows: clip only"
        return None
    if recipe == "plain":
        return None
    if aggregation not in AGGREGATIONS:
        return f"unknown aggregation {aggregation!r}"
    if recipe in HAND_AGGREGATED and aggregation not in RECIPE_AGGREGATE:
        return f"no {recipe} recipe for {aggregation}"
    if recipe in HAND_AGGREGATED and kind in LM_KINDS:
        return f"the {recipe} recipe is written for one label per example"
    if recipe in ("pergrad-mat", "pergrad-stats") and not HAS_PATH:
        return "this checkout's PerExampleModel has no path= argument"
    if recipe not in HAND_AGGREGATED + tuple(PERGRAD_PATHS):
        return f"unknown recipe {recipe!r}"
    return None


def make_variant(name: str, kind: str) -> keras.Model:
    """The compiled Keras model of a Keras-built variant (plain, pergrad, jacobian, vmap)."""
    inner = build_model(kind)
    if name == "plain":
        model = inner
    else:
        recipe, aggregation = split_variant(name)
        if recipe in PERGRAD_PATHS:
            # path= only where this checkout has it: "auto" picks the statistics
            # path for statistics rules; the materialized engine is the reference
            kwargs = {"path": PERGRAD_PATHS[recipe]} if HAS_PATH else {}
            model = pergrad.PerExampleModel(inner, pergrad_aggregator(aggregation), **kwargs)
        else:
            model = Recipe(inner, recipe, aggregation, kind)
    model.compile(optimizer=new_optimizer(), loss=new_loss(kind))
    return model


def make_stepper(name: str, kind: str, x, y, checked: bool = True) -> Steps:
    """A built, compiled, once-stepped variant; raises :class:`Skipped` where it does not apply.

    ``checked``: a peer's update is checked against pergrad's before it is timed
    (not in the memory subprocesses).
    """
    reason = unsupported(name, kind)
    if reason:
        raise Skipped(reason)
    recipe, aggregation = split_variant(name)
    if recipe in ("opacus", "opacus-plain"):
        return TorchStepper(kind, x, y, private=recipe == "opacus")
    if recipe in peers.RECIPES:
        return peers.make_stepper(recipe, aggregation, kind, x, y, checked=checked)
    return Stepper(make_variant(name, kind), x, y)


#: variants whose own baseline is not the Keras plain step
OWN_PLAIN = {"opacus clip": "opacus-plain", **peers.OWN_PLAIN}


def default_recipes() -> list[str]:
    recipes = ["jacobian", "vmap", "pergrad"]
    if HAS_PATH:
        recipes.append("pergrad-mat")
    if BACKEND == "torch" and opacus is not None:
        recipes.append("opacus")
    return recipes + peers.recipes_for(BACKEND)


def quick_variants() -> list[str]:
    """``--quick``'s rows of the default suite."""
    opacus_rows = QUICK_OPACUS if BACKEND == "torch" and opacus is not None else ()
    return list(QUICK_VARIANTS + opacus_rows)


def variant_names(selected_aggregations, recipes, kind) -> list[str]:
    """The default suite's rows of a ``kind`` model: every recipe x aggregation that applies."""
    names = ["plain"]
    for recipe in recipes:
        if recipe == "opacus":
            if "clip" in selected_aggregations and not unsupported("opacus clip", kind):
                names += ["opacus-plain", "opacus clip"]
            continue
        if recipe in peers.RECIPES:  # a peer not installed: a "skipped: not installed" row
            names += [n for n in peers.variant_names(recipe, selected_aggregations)
                      if not unsupported(n, kind) or not peers.installed(recipe)]
            continue
        for aggregation in selected_aggregations:
            if recipe == "jacobian" and aggregation != "clip":
                # the jacobian costs ~B backward passes whatever follows; its median
                # row took minutes per backend (ask for it with --variants)
                continue
            if recipe == "pergrad-mat" and aggregation not in STATISTICS_AGGREGATIONS:
                continue  # the coordinate rules' materialized rows: --suite coordinate
            name = f"{recipe} {aggregation}"
            if not unsupported(name, kind):
                names.append(name)
    return names


def coordinate_variants(key: str) -> list[str]:
    """``--suite coordinate``: the coordinate rules' rows of model ``key``.

    The plain step, the jacobian median recipe (the CNN, and MLPs up to
    ``COORDINATE_JACOBIAN_MLP_BATCH``), the materialized median beside the
    default path's, and every coordinate rule on the default path.
    """
    kind, batch_size = parse_model(key)
    names = ["plain"]
    if kind != "mlp" or batch_size <= COORDINATE_JACOBIAN_MLP_BATCH:
        names.append("jacobian median")
    if HAS_PATH:
        names.append("pergrad-mat median")
    return names + [f"pergrad {a}" for a in COORDINATE_AGGREGATIONS]


def row_names(key: str, args) -> tuple[list[str], list[str]]:
    """The variants of model ``key`` in this run: the rows, and those measured for memory.

    ``--variants`` overrides the suite's list; plain is always a row (the ratios'
    reference) and measured for memory (the peaks').
    """
    kind, _ = parse_model(key)
    if args.variants:
        names = list(args.variants)
    elif args.suite == "coordinate":
        names = coordinate_variants(key)
    elif kind in HUB_KINDS + RNN_KINDS:
        names = [name for name in LM_VARIANTS if not unsupported(name, kind)]
    elif kind in CONV_KINDS:
        names = [name for name in CONV_VARIANTS if not unsupported(name, kind)]
    else:
        names = variant_names(args.aggregations, args.recipes, kind)
    if "plain" not in names:
        names.insert(0, "plain")
    if not args.memory_variants:
        return names, names
    measured = [n for n in names if n == "plain" or n in args.memory_variants]
    return (measured if args.memory_only else names), measured
