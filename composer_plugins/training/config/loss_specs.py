"""The ``losses`` section of the training config: one channel spec parsed, the list form, names and weights.

:func:`channel_spec` is the one parser of a ``losses.<key>`` entry; :func:`losses_mapping` turns the list form
(docs/losses.md) into the mapping; :func:`check_channel` refuses, when the config is read, an unregistered
loss, an undeclared negative weight or an entry the class's ``check_spec`` refuses.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from composer_plugins.core.config import Config, build_component, check_component_name
from composer_plugins.core.errors import PluginDeprecationWarning, UnknownPluginError
from composer_plugins.core.plugins import get_registry
from composer_plugins.core.registry import import_object
from composer_plugins.core.version import ADAPTERS_REMOVED_IN

CHANNEL_KEYS = ("enabled", "weight", "name", "advantage")


def check_channel(key: str, ch: ChannelSpec, src: Config, pre: str) -> None:
    """An enabled channel names a registered loss (``--print-config`` included) and, when its weight is
    negative, one that declares ``allows_negative_weight``; located at ``losses.<key>[.name|.weight]``."""
    where = f"{pre}losses.{key}"
    if ch.advantage is not None:
        advantage_estimator(ch.advantage, f"{where}.advantage", src, build=False)
    if "class_path" in ch.kwargs:
        return
    entry = _loss_entry(ch, src, where)
    if isinstance(entry.target, str) and entry.target.startswith("composer_plugins.") and "torch" not in sys.modules:
        return  # a built-in keeps its contract (CI checks it), and a config error or --print-config imports no torch
    broken = entry.contract_problem()  # a plugin that fails its contract check: refused here, before any stage
    if broken:
        raise src.error(
            where if ch.name == key else f"{where}.name",
            f"{entry.kind} {ch.name!r} ({entry.provider or entry.plugin}) fails its contract check: {broken}",
        )
    check = getattr(entry.factory, "check_spec", None)  # a channel that declares what it cannot train with
    problem = check(ch.options) if callable(check) else None
    if problem:
        raise src.error(f"{where}.{problem[0]}", problem[1])
    if ch.weight < 0:
        from composer_plugins.losses.base import check_weight

        try:
            check_weight(entry.factory, ch.weight, key)
        except ValueError as e:
            raise src.error(f"{where}.weight", str(e)) from e


def _loss_entry(ch: ChannelSpec, src: Config, where: str) -> Any:
    """The registry entry of the loss ``ch`` names; an unknown name is refused at ``where`` (``.name`` if given)."""
    try:
        return get_registry().get("losses", ch.name)
    except UnknownPluginError as e:
        raise src.error(f"{where}.name" if ch.name != ch.key else where, str(e)) from e


def advantage_estimator(spec: Any, key: str, src: Config | None = None, build: bool = True) -> Any:
    """A channel's ``advantage:`` (registry kind ``advantage_estimators``): a name, ``{name: ..., <settings>}``, or
    ``{compose: [{name: ..., weight: w, <settings>}, ...]}`` (``Σ w·A``); ``build=False`` only checks the names.
    Errors are located at ``key`` (``<key>.compose.<i>.name`` ...) in ``src``'s file and line."""
    src, kind = (src if src is not None else Config()), "advantage_estimators"
    if not (isinstance(spec, Mapping) and "compose" in spec):
        return build_component(kind, spec, key, src) if build else check_component_name(kind, spec, key, src)
    parts, extra = spec["compose"], sorted(set(spec) - {"compose"})
    if extra or not isinstance(parts, list) or not parts:
        where, got = (f"{key}.{extra[0]}", "a key next to compose") if extra else (f"{key}.compose", repr(parts))
        raise src.error(
            where, f"expected compose: [{{name: group, weight: 0.7}}, {{name: rloo, weight: 0.3}}], got {got}"
        )
    out = []
    for i, part in enumerate(parts):
        part = dict(part) if isinstance(part, Mapping) else part
        weight = part.pop("weight", 1.0) if isinstance(part, dict) else 1.0
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise src.error(f"{key}.compose.{i}.weight", f"expected a number, got {weight!r}.")
        out.append((float(weight), advantage_estimator(part, f"{key}.compose.{i}", src, build)))
    if build:
        from composer_plugins.losses.advantages import ComposedAdvantage

        return ComposedAdvantage(out)
    return None


def warn_advantage_kwargs(kwargs: Mapping[str, Any], key: str, src: Config) -> None:
    """The deprecated ``rollout.advantage_kwargs`` (still honoured until 0.3): a warning located at ``key``,
    naming the policy channel's ``advantage`` spec that replaces it."""

    kw = dict(kwargs)
    name = "rloo" if kw.pop("estimator", "grpo") == "rloo" else "group"
    spec = ", ".join(f"{k}: {v}" for k, v in {"name": name, **kw}.items())
    fix = f"set losses.<key>.advantage: {{{spec}}} on the policy channel"
    msg = f"is deprecated (removed in composer-plugins {ADAPTERS_REMOVED_IN}). Fix: {fix}."
    warnings.warn(str(src.error(key, msg)), PluginDeprecationWarning, stacklevel=3)


class ChannelSpec(NamedTuple):
    """One ``losses.<key>`` entry, parsed: whether it is on, its registry name, weight, the channel's own kwargs
    (``class_path``/``init_args`` for a class given by path), its key and its advantage estimator's spec."""

    enabled: bool
    name: str
    weight: float
    kwargs: dict[str, Any]
    key: str = ""
    #: ``losses.<key>.advantage``: the estimator of the advantages it reads (not an argument of the channel)
    advantage: Any = None

    @property
    def active(self) -> bool:
        """Enabled and with a non-zero weight (what the study counts as a channel that is on)."""
        return self.enabled and self.weight != 0.0

    @property
    def options(self) -> dict[str, Any]:
        """Every option the entry sets besides ``enabled``/``weight``/``name``: its kwargs and ``advantage``."""
        return self.kwargs if self.advantage is None else {**self.kwargs, "advantage": self.advantage}

    def component(self) -> Any:
        """The channel's component spec for :func:`~composer_plugins.core.config.build_component`: its name (with
        its kwargs), or its ``class_path``/``init_args``."""
        if "class_path" in self.kwargs or (self.name == self.key and not self.kwargs):
            return dict(self.kwargs) or self.name
        return {"name": self.name, **self.kwargs}


def channel_spec(key: str, spec: Any, src: Config | None = None, pre: str = "") -> ChannelSpec:
    """Parse one ``losses.<key>`` entry (the one parser of channel specs: training, backends, pipeline).

    ``spec`` is ``true``/``false``/``null``, a number (the weight) or a mapping with ``enabled``,
    ``weight``, ``name`` (registry name, default ``key``) and the channel's own kwargs. Errors name
    ``<pre>losses.<key>[.field]`` in ``src``'s file and line.
    """
    src = src if src is not None else Config()
    where = f"{pre}losses.{key}"
    if spec is None or isinstance(spec, bool):
        return ChannelSpec(bool(spec), key, 1.0, {}, key)
    if isinstance(spec, int | float):
        return ChannelSpec(True, key, float(spec), {}, key)
    if not isinstance(spec, Mapping):
        raise src.error(where, f"expected a mapping like {{weight: 1.0}}, true/false or a weight; got {spec!r}.")
    spec = dict(spec)
    enabled = spec.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise src.error(f"{where}.enabled", f"expected true or false, got {enabled!r}.")
    weight = spec.pop("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise src.error(f"{where}.weight", f"expected a number, got {weight!r}.")
    name, advantage = str(spec.pop("name", key)), spec.pop("advantage", None)
    return ChannelSpec(enabled, name, float(weight), spec, key, advantage)


def losses_mapping(items: Any, src: Config | None = None, pre: str = "") -> Any:
    """The mapping form of a ``losses`` list (``- {name: grpo, weight: 1.0, label: ...}``); other values as given.

    Each item's key is its ``label`` (the channel's name in metrics), else its ``name`` (or the class
    name of a ``class_path``), in list order. A bad item or two items with one key are refused, located
    at ``<pre>losses.<i>`` in ``src`` and with the fix.
    """
    if not isinstance(items, list):
        return items
    src = src if src is not None else Config()
    out: dict[str, Any] = {}
    for i, item in enumerate(items):
        where = f"{pre}losses.{i}"
        if isinstance(item, str):
            key, spec = item, {}
        elif isinstance(item, Mapping) and ("name" in item or "class_path" in item):
            spec = dict(item)
            label = spec.pop("label", None)
            default = spec.get("name") or str(spec.get("class_path", "")).rpartition(".")[2]
            key = str(label if label is not None else default)
        else:
            raise src.error(
                where,
                f"a list item of losses must be a channel name or a mapping with name: ..., got {item!r}; "
                "e.g. - {name: grpo, weight: 1.0}  (or the mapping form  losses: {grpo: {weight: 1.0}})",
            )
        if key in out:
            field_ = "label" if isinstance(item, Mapping) and "label" in item else "name"
            raise src.error(
                f"{where}.{field_}" if isinstance(item, Mapping) else where,
                f"a second loss channel keyed {key!r} (item {list(out).index(key)} has it); "
                f"give one of them a distinct label: ..., e.g. label: {key}_2.",
            )
        out[key] = spec
    return out


def losses_as_mapping(src: Config) -> None:
    """``losses`` given as a list becomes the mapping form; its file lines move with it (errors stay located)."""
    items = src.get("losses")
    if not isinstance(items, list):
        return
    out = losses_mapping(items, src)
    moved = {f"losses.{i}": f"losses.{k}" for i, k in enumerate(out)}
    lines = {}
    for k, line in src.lines.items():
        head = ".".join(k.split(".")[:2])
        if head in moved:
            if k.endswith(".label") and k.count(".") == 2:
                continue
            k = moved[head] + k[len(head) :]
        lines[k] = line
    src.lines = lines
    src["losses"] = out


class DeclaredChannel(NamedTuple):
    """An enabled ``losses.<key>`` entry with what its registered class declares (read without building it):
    what an adapter dispatches on, never the channel's name."""

    key: str
    name: str
    weight: float
    kwargs: dict[str, Any]
    #: every input the class reads (``requires`` and each ``input_options`` alternative)
    inputs: frozenset[str]
    #: the class needs a teacher forward on hinted contexts (``needs_teacher``)
    needs_teacher: bool
    #: the policy-gradient loss it computes (``loss_type`` preset by its registry entry or given), if any
    loss_type: str | None
    #: the kind the class declares (``LossChannel.kind``), ``None`` for a class from before 0.2.3
    kind: str | None = None

    @property
    def is_policy(self) -> bool:
        """A policy-gradient channel: declared ``policy`` (undeclared: it reads the group advantages)."""
        return self.kind == "policy" if self.kind is not None else "advantages" in self.inputs

    @property
    def reads_teacher_scores(self) -> bool:
        """It reads external teachers' scores of the student's tokens."""
        return "teacher_scores" in self.inputs


def declared_channels(losses: Any, src: Config | None = None) -> list[DeclaredChannel]:
    """The enabled channels of a :class:`~composer_plugins.training.config.train.TrainConfig` (its parsed
    ``channels``) or of a ``losses`` mapping, with their declarations (located errors for unknown names)."""

    src = src if src is not None else Config()
    out = []
    specs = losses.channels if hasattr(losses, "channels") else [channel_spec(k, v, src) for k, v in losses.items()]
    for ch in specs:
        if not ch.enabled:
            continue
        preset: dict[str, Any] = {}
        if "class_path" in ch.kwargs:
            cls: Any = import_object(str(ch.kwargs["class_path"]))
        else:
            entry = _loss_entry(ch, src, f"losses.{ch.key}")
            cls, preset = entry.factory, dict(entry.init_params)
        inputs = frozenset({*getattr(cls, "requires", ()), *(k for g in getattr(cls, "input_options", ()) for k in g)})
        loss_type = ch.kwargs.get("loss_type", preset.get("loss_type"))
        loss_type = None if loss_type is None else str(loss_type)
        teacher, kind = bool(getattr(cls, "needs_teacher", False)), getattr(cls, "kind", None)
        out.append(DeclaredChannel(ch.key, ch.name, ch.weight, dict(ch.options), inputs, teacher, loss_type, kind))
    return out
