"""A sweep's points: Hydra's multirun grammar expanded, and each point's id. (The layout check that
prunes a point before any capture is the config's own validation: sweep/evaluate.py `point_config`.)

`expand` reads the overrides with Hydra's own parser: `parallel.tp=2,4,8`, `parallel.pp=range(1,5)`,
`model=choice(tiny,tiny_moe)`, `model=glob(llama*)` (the model presets are the config group),
`train.micro_batch_size=1,2`; quote values that look like calls (`moe.imbalance='zipf(1.2)'`). The
points are the cartesian product, in the order given. `split_hydra` keeps Hydra's own overrides
(`hydra/launcher=submitit_slurm`, `hydra.launcher.partition=gpu`, `hydra.sweeper.search=optuna`)
apart from the points'.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Optional

from prism_megatron.config.schema import ConfigError


@dataclass(frozen=True)
class Axis:
    """One key of the sweep and its values, as override strings (`parallel.tp=2`)."""

    key: str
    values: tuple[str, ...]

    @property
    def swept(self) -> bool:
        return len(self.values) > 1


@dataclass
class SweepSpace:
    """The axes of a sweep (every override, swept or fixed) in the order given."""

    axes: list[Axis] = field(default_factory=list)

    def points(self) -> list[list[str]]:
        """The cartesian product of the axes, in order."""
        return [list(p) for p in itertools.product(*(a.values for a in self.axes))] if self.axes else [[]]

    def swept_keys(self) -> list[str]:
        return [a.key for a in self.axes if a.swept]


def is_app_key(item: str) -> bool:
    """An override of the app rather than of a point: Hydra's (`hydra/...=`, `hydra.`) or the sweep
    section's (`sweep.captures=DIR`)."""
    key = item.lstrip("+~").partition("=")[0]
    return key == "hydra" or key.startswith(("hydra/", "hydra.", "sweep."))


def split_hydra(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the points' overrides, the app's: see `is_app_key`)."""
    mine = [o for o in overrides if not is_app_key(o)]
    return mine, [o for o in overrides if is_app_key(o)]


def parse_space(overrides: list[str], presets: Optional[list[str]] = None) -> SweepSpace:
    """The axes of `overrides` in Hydra's multirun grammar (see the module docstring); `presets`: the
    names `model=glob(...)` chooses from."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes: list[Axis] = []
    for item in overrides:
        try:
            (parsed,) = parser.parse_overrides([item])
        except HydraException as err:
            if "," in item.partition("=")[2] or "(" not in item:
                raise ConfigError(f"sweep override {item!r} does not parse in Hydra's multirun grammar "
                                  f"({str(err).splitlines()[0]}); write key=a,b or key=range(1,5), and quote "
                                  "values that look like calls: moe.imbalance='zipf(1.2)'") from None
            axes.append(Axis(item.partition("=")[0], (item,)))  # a value Hydra reads as a call: as written
            continue
        key = parsed.key_or_group
        value = parsed.value()
        if isinstance(value, Glob):
            if key != "model" or presets is None:
                raise ConfigError(f"sweep override {item!r}: glob() chooses among a config group's options, "
                                  f"and {key} is none (the group is model=, its presets); list the values: "
                                  f"{key}=a,b")
            names = value.filter(sorted(presets))
            if not names:
                raise ConfigError(f"sweep override {item!r} matches no model preset; the presets: "
                                  f"{', '.join(sorted(presets))}")
            axes.append(Axis(key, tuple(f"{key}={n}" for n in names)))
        elif parsed.is_sweep_override():
            try:
                values = list(parsed.sweep_string_iterator())
            except HydraException as err:
                raise ConfigError(f"sweep override {item!r}: {str(err).splitlines()[0]}") from None
            if not values:
                raise ConfigError(f"sweep override {item!r} has no value; e.g. {key}=1,2 or {key}=range(1,5)")
            axes.append(Axis(key, tuple(f"{key}={v}" for v in values)))
        else:
            axes.append(Axis(key, (f"{key}={parsed.get_value_element_as_str()}",)))
    return SweepSpace(axes)


def expand(overrides: list[str], presets: Optional[list[str]] = None) -> list[list[str]]:
    """The points of a multirun override list (cartesian product of the sweeps, in order)."""
    return parse_space(overrides, presets).points()


def point_id(overrides: list[str], script: Optional[list[str]] = None) -> str:
    """A point's id: its overrides, and the script when there is one (another script's rows are not
    this sweep's)."""
    items = [*overrides, "--", *script] if script else list(overrides)
    return hashlib.sha256("\x1f".join(items).encode()).hexdigest()[:12]


def values_of(overrides: list[str], keys: list[str]) -> dict[str, str]:
    """The value each of `keys` has in a point's overrides ('' where the point does not set it)."""
    given = {}
    for o in overrides:
        key, _, value = o.partition("=")
        given[key] = value
    return {k: given.get(k, "") for k in keys}
