"""Each distillation method's own training recipe, as the recipe sweep chose it.

[`FrontierConfig`][mumoe_tn.distillation.study.FrontierConfig] trains every method with one shared
recipe by default; ``method_recipes=`` gives some methods their own (pairs of a method name and
a name of [`RECIPES`][mumoe_tn.distillation.trainer.RECIPES]), and
[`BEST_RECIPES`][mumoe_tn.distillation.methods.BEST_RECIPES] (kept with the methods) is the table
``python -m benchmarks.recipe_sweep`` chose: one seed of the default small model (a GPT-2 shape of
width 64, two layers, byte tokens), L0 8 and 32, 200,000 tokens, every method under every
candidate recipe that applies to it, and per method the recipe with the best mean CE-loss score
(a tie within 0.0005: the shared ``"mxd-paper"``). The sweep's table is in
``benchmarks/recipe-sweep-cpu.md`` and the distillation guide. The table holds recipes, not loss
weights: where the sweep's best also changed the balance term's weight (flat CP: half the
default), the method keeps its recipe with the factory's default weight.
"""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.distillation.trainer import RECIPES

__all__ = ["check_method_recipes", "recipe_of"]


def check_method_recipes(pairs: object) -> dict[str, str]:
    """``pairs`` of (method name, recipe name) as a mapping, each recipe checked against ``RECIPES``.

    Raises
    ------
    TypeError
        If ``pairs`` is not a sequence of (str, str) pairs.
    ValueError
        If a recipe is not in ``RECIPES`` or a method is named twice.
    """
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise TypeError(f"method_recipes must be a tuple of (method, recipe) pairs, got {pairs!r:.80}")
    chosen: dict[str, str] = {}
    for pair in pairs:
        if not isinstance(pair, Sequence) or len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise TypeError(
                f"every entry of method_recipes must be a (method, recipe) pair of strings, got {pair!r:.80}"
            )
        method, recipe = pair
        if recipe not in RECIPES:
            raise ValueError(f"method_recipes gives {method!r} the recipe {recipe!r}: use one of {sorted(RECIPES)}")
        if method in chosen:
            raise ValueError(f"method_recipes names {method!r} twice")
        chosen[method] = recipe
    return chosen


def recipe_of(method: str, pairs: Sequence[tuple[str, str]], default: str) -> str:
    """The recipe ``pairs`` give ``method``, or ``default`` where they name none."""
    return check_method_recipes(pairs).get(method, default)
