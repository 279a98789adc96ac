"""The loss-channel contract and the composer that sums channels (docs/losses.md, "The channel contract").

:class:`LossChannel` declares its inputs and maps the one ``inputs`` mapping to ``(loss, metrics)``;
:class:`ChannelComposer` returns ``Σ weight_i · loss_i``, skipping and reporting (``<name>/skipped``,
``<name>/missing``) a channel whose inputs are absent instead of giving a fake zero loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from composer_plugins.core.errors import PluginDeprecationWarning
from composer_plugins.core.version import ADAPTERS_REMOVED_IN, adapters_served

#: The kinds a channel declares (``LossChannel.kind``); backends answer per kind (``policy`` per loss type).
CHANNEL_KINDS = ("policy", "hint", "teacher", "pairs", "custom")


class LossChannel(nn.Module):
    """Base class of every loss channel (built-in or third-party).

    Subclasses set ``requires`` (the ``inputs`` keys the channel reads) and implement
    :meth:`forward`. ``weight`` scales the channel inside :class:`ChannelComposer`.
    """

    #: What the channel is, for the channel × backend table (:data:`CHANNEL_KINDS`): ``policy`` (a policy-gradient
    #: loss over the group advantages; its row is ``policy:<loss_type>``), ``hint`` (hint self-distillation),
    #: ``teacher`` (external teachers' scores), ``pairs`` (preference pairs) or ``custom``. ``None`` (a channel
    #: written before 0.2.3): read from its inputs, with a deprecation warning, until 0.3.0.
    kind: ClassVar[str | None] = None
    #: Keys of ``inputs`` this channel reads; absent keys skip the channel.
    requires: ClassVar[tuple[str, ...]] = ()
    #: True when the channel needs a teacher forward pass (hint distillation).
    needs_teacher: ClassVar[bool] = False
    #: True when the channel needs reference-model log-probs.
    needs_reference: ClassVar[bool] = False
    #: Alternative input groups; when non-empty, at least one group must be fully present.
    input_options: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: True for a channel whose loss is meant to be ascended (a negative ``weight``); every other channel
    #: refuses one, since ``weight < 0`` turns its descent into gradient ascent.
    allows_negative_weight: ClassVar[bool] = False
    #: True when the channel's loss is a sum of per-row terms of ``logprobs`` (each row's term reads only its own
    #: row; batch-wide constants such as token counts are fine): the training step may then form the LM-head
    #: gradients of ``logprobs`` while computing them (three matmuls a chunk instead of four).
    row_separable: ClassVar[bool] = False

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__()
        check_weight(type(self), weight, name or type(self).__name__)
        self.weight = float(weight)
        self.name = name or type(self).__name__

    def required_inputs(self) -> tuple[str, ...]:
        """Keys this channel needs for its current configuration (default: ``requires``)."""
        return tuple(self.requires)

    def missing_inputs(self, inputs: Mapping[str, Any]) -> list[str]:
        """Required keys absent from ``inputs`` (or present but ``None``).

        With ``input_options``, an incomplete set of alternatives is reported as one entry
        ``"a+b|c+d"`` (every alternative, ``+`` joining the keys of one group).
        """
        missing = [k for k in self.required_inputs() if not has_input(k, inputs)]
        options = self.input_options
        if options and not any(all(has_input(k, inputs) for k in grp) for grp in options):
            missing.append("|".join("+".join(grp) for grp in options))
        return missing

    @staticmethod
    def get(key: str, inputs: Mapping[str, Any], *, default: Any = None) -> Any:
        """``inputs[key]`` if present and not None, else ``default``."""
        v = inputs.get(key)
        return default if v is None else v

    @classmethod
    def contract_problem(cls) -> str | None:
        """Why this class does not keep the channel contract (:func:`check_contract`), or ``None``: what
        ``composer-plugins plugins``/``list`` and the config's loader ask of a registered channel."""
        try:
            check_contract(cls)
        except TypeError as e:
            return str(e)
        return None

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Return ``(scalar loss, metrics)`` for these inputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(inputs)")

    def extra_repr(self) -> str:
        return f"name={self.name!r}, weight={self.weight}"


class ChannelComposer(nn.Module):
    """Sums ``weight · loss`` over channels, skipping (and reporting) channels whose inputs are absent."""

    def __init__(self, channels: Sequence[LossChannel]) -> None:
        super().__init__()
        for c in channels:
            check_contract(type(c))
        names = [c.name for c in channels]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"two loss channels share the name(s) {sorted(dupes)}; give each a distinct name=")
        self.channels = nn.ModuleList(channels)

    @classmethod
    def from_specs(cls, specs: Sequence[Any]) -> ChannelComposer:
        """Build from registry specs: ``"dapo"``, ``{"name": "hint_distill", "weight": 0.5, ...}``,
        ``{"class_path": ..., "init_args": ...}`` or already-built :class:`LossChannel` objects."""
        from composer_plugins.core.config import build_component

        built: list[LossChannel] = []
        for i, spec in enumerate(specs):
            ch = spec if isinstance(spec, LossChannel) else build_component("losses", spec, key=f"losses[{i}]")
            if not isinstance(ch, LossChannel):
                raise TypeError(f"losses[{i}]: {spec!r} built a {type(ch).__name__}, not a LossChannel")
            built.append(ch)
        return cls(built)

    def __getitem__(self, name: str) -> LossChannel:
        for ch in self.channels:
            if ch.name == name:
                return ch  # type: ignore[return-value]
        raise KeyError(f"no loss channel named {name!r}; channels: {[c.name for c in self.channels]}")

    @property
    def names(self) -> list[str]:
        """Channel names, in order."""
        return [c.name for c in self.channels]

    @property
    def needs_teacher(self) -> bool:
        """True when an active channel needs a teacher forward pass."""
        return any(c.needs_teacher and c.weight != 0.0 for c in self.channels)

    @property
    def needs_reference(self) -> bool:
        """True when an active channel needs reference-model log-probs."""
        return any(c.needs_reference and c.weight != 0.0 for c in self.channels)

    @property
    def active(self) -> list[LossChannel]:
        """The channels whose weight is not zero (the ones that contribute a loss)."""
        return [c for c in self.channels if c.weight != 0.0]  # type: ignore[misc]

    def required_inputs(self) -> tuple[str, ...]:
        """The inputs the active channels read, in order and without repeats.

        Each active channel's :meth:`LossChannel.required_inputs` and, where it offers alternatives
        (``input_options``), the keys of its first (preferred) alternative. This is what an assembler
        of channel inputs builds (:func:`composer_plugins.training.step.assemble.assemble_inputs`).
        """
        out: list[str] = []
        for c in self.active:
            out += [*c.required_inputs(), *(c.input_options[0] if c.input_options else ())]
        return tuple(dict.fromkeys(out))

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """``(Σ weight · loss, metrics)`` over the live channels, each reading the one ``inputs`` mapping."""
        total: Tensor | None = None
        metrics: dict[str, Any] = {}
        for ch in self.channels:
            if ch.weight == 0.0:
                metrics[f"{ch.name}/skipped"] = 1.0
                continue
            missing = ch.missing_inputs(inputs)
            if missing:
                metrics[f"{ch.name}/skipped"] = 1.0
                metrics[f"{ch.name}/missing"] = ",".join(missing)
                continue
            loss, m = ch(inputs_for(ch, inputs))
            metrics[f"{ch.name}/skipped"] = 0.0
            metrics[f"{ch.name}/loss"] = loss.detach()
            for k, v in m.items():
                metrics[f"{ch.name}/{k}"] = v
            term = ch.weight * loss
            total = term if total is None else total + term
        if total is None:
            total = torch.zeros((), device=_first_tensor_device(inputs), requires_grad=False)
        metrics["loss"] = total.detach()
        return total, metrics


def inputs_for(channel: Any, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``inputs`` as ``channel`` reads them: with its own ``advantages`` when it has an estimator (set from
    ``losses.<key>.advantage`` as ``advantage_estimator``), computed from the step's rewards (NaN: unscorable)."""
    est = getattr(channel, "advantage_estimator", None)
    if est is None:
        return inputs
    r = inputs.get("rewards")
    if r is None:
        raise ValueError(
            f"loss channel {channel.name!r} has an advantage estimator (losses.{channel.name}.advantage) but this "
            f"step has no rewards to estimate from (a trainer that records none): remove its advantage setting"
        )
    return {**inputs, "advantages": est(r.float(), int(inputs["num_generations"])).to(r.device).float()}


def check_weight(cls: type, weight: float, name: str) -> None:
    """Refuse ``weight < 0`` (gradient ascent on the channel) unless ``cls`` declares ``allows_negative_weight``."""
    if float(weight) < 0 and not getattr(cls, "allows_negative_weight", False):
        raise ValueError(
            f"loss channel {name!r}: weight {weight} is negative, which turns minimising its loss into gradient "
            f"ascent; give a weight >= 0 (0 turns the channel off). A channel meant to be ascended declares "
            f"allows_negative_weight = True on its class ({cls.__name__} does not)."
        )


def check_contract(cls: type) -> None:
    """Refuse a channel class whose ``forward`` does not take the one ``inputs`` mapping.

    A channel written for the previous contract (plugin API 1, ``forward(model_outputs, batch)``) is adapted
    while the package serves that contract (:func:`composer_plugins.core.version.adapters_served`): its
    ``forward`` is called with the one mapping as both arguments (and its API-1 ``self.get(key, model_outputs,
    batch, default=None)`` reads that mapping), after one ``DeprecationWarning`` naming its file:line and the
    fix. Any other shape (and that one from 0.3.0 on) is refused, naming the same.
    """
    kind = getattr(cls, "kind", None)
    if kind is not None and kind not in CHANNEL_KINDS:
        raise TypeError(f"loss channel {cls.__qualname__} declares kind = {kind!r}; valid: {', '.join(CHANNEL_KINDS)}")
    fwd = getattr(cls, "forward", None)
    if fwd is None or fwd is LossChannel.forward or "_api1_forward" in vars(cls):
        return
    try:
        params = list(inspect.signature(fwd).parameters.values())[1:]  # drop self
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) <= 1 and (positional or varargs):
        return
    try:
        where = f"{inspect.getsourcefile(fwd)}:{inspect.getsourcelines(fwd)[1]}: "
    except (OSError, TypeError):
        where = ""
    sig = ", ".join(p.name for p in positional)
    if len(required) == 2 and len(positional) == 2 and adapters_served():
        _adapt_two_mappings(cls, fwd, where, sig)
        return
    raise TypeError(
        f"{where}loss channel {cls.__module__}.{cls.__qualname__}.forward({sig}) does not take one inputs mapping; "
        f"the contract is forward(self, inputs) -> (loss, metrics), reading each field with "
        f"self.get(key, inputs) (model outputs and record fields sit in the one mapping)"
    )


def _adapt_two_mappings(cls: type, fwd: Any, where: str, sig: str) -> None:
    """Serve a plugin-API-1 channel (``forward(model_outputs, batch)``): both arguments get the one mapping."""
    import warnings

    def forward(self: Any, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        return fwd(self, inputs, inputs)

    def get(key: str, inputs: Mapping[str, Any], batch: Any = None, default: Any = None) -> Any:
        # API 1's documented get(key, model_outputs, batch, default=None): both mappings are the one mapping
        return LossChannel.get(key, inputs, default=default)

    cls._api1_forward = fwd  # type: ignore[attr-defined]
    cls.forward = forward  # type: ignore[attr-defined]
    if cls.get is LossChannel.get:  # a channel with its own get keeps it
        cls.get = staticmethod(get)  # type: ignore[attr-defined]
    warnings.warn(
        f"{where}loss channel {cls.__module__}.{cls.__qualname__}.forward({sig}) uses the plugin API 1 contract, "
        f"served through an adapter until composer-plugins {ADAPTERS_REMOVED_IN}. Fix: "
        f"def forward(self, inputs): read each field with self.get(key, inputs) (one mapping).",
        PluginDeprecationWarning,
        stacklevel=2,
    )


def has_input(key: str, inputs: Mapping[str, Any]) -> bool:
    """True when ``key`` is present in ``inputs`` and not None."""
    return inputs.get(key) is not None


def _first_tensor_device(inputs: Mapping[str, Any]) -> torch.device:
    return next((v.device for v in inputs.values() if isinstance(v, Tensor)), torch.device("cpu"))
