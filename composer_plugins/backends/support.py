"""Which loss channel runs in which backend mode: collected from what each backend declares, checked when it is built.

Each backend class declares ``support`` (``{mode: {channel kind: Cell}}``); this module only collects, checks
and renders it, so a third-party backend gets its rows without editing the core. A channel's kind is read from
what it declares, never its name (:func:`channel_kind`); a refused cell is refused when the backend is built
(:func:`check_channels`), never dropped during the run. docs/backends.md "Which channel runs where" holds
:func:`markdown_table` of the built-in channels; a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADVANTAGE",
    "CLIP_OPTIONS",
    "NEUTRAL_OPTIONS",
    "Cell",
    "builtin_channels",
    "cell",
    "channel_kind",
    "check_channels",
    "declared",
    "markdown_table",
    "support_table",
]

RUNS, LIMITS, REFUSED = "runs", "limits", "refused"
#: The row (and cell kind) of a channel's configured advantage estimator (``losses.<key>.advantage``): a composing
#: mode honours it (``ChannelComposer`` computes the channel's advantages); a declaring one says so in its cells.
ADVANTAGE = "advantage"


@dataclass(frozen=True)
class Cell:
    """One (mode, channel) answer: ``status`` is ``runs``, ``limits`` or ``refused``; ``note`` says what differs
    (``limits``) or why, and what to do instead (``refused``)."""

    status: str
    note: str = ""
    #: The channel options the mode passes on (``None``: all of them); any other option set to something
    #: other than its default is refused by :func:`check_channels`, never silently dropped.
    carries: frozenset[str] | None = None

    @property
    def runs(self) -> bool:
        """True for ``runs`` and ``limits`` (the channel contributes a loss)."""
        return self.status != REFUSED


#: Options no mode needs to carry: they name the channel or size its chunks, they do not change its loss.
NEUTRAL_OPTIONS = frozenset({"chunk_size", "label", "loss_type", "name"})
#: The clip-range options of the policy channels (what a re-implemented policy loss usually carries).
CLIP_OPTIONS = frozenset({"epsilon_low", "epsilon_high", "dppo_mask_low", "dppo_mask_high"})


def declared() -> dict[str, Mapping[str, Cell] | None]:
    """``{mode: cells}`` from the ``support`` of every registered backend whose class imports, in registry order
    (a backend's declaration imports without its upstream trainer: PRIME-RL's local mode runs without it)."""
    from composer_plugins.core.plugins import get_registry

    out: dict[str, Mapping[str, Cell] | None] = {}
    for entry in get_registry().entries("backends"):
        out.update(_declared_by(entry))
    return out


def _declared_by(entry: Any) -> Mapping[str, Mapping[str, Cell] | None]:
    try:
        return getattr(entry.factory, "support", None) or {}
    except ImportError:
        return {}


def __getattr__(name: str) -> Any:
    """``MODES`` (every declared mode, in table order) and ``COMPOSING`` (the modes that compose channels)."""
    if name == "MODES":
        return tuple(declared())
    if name == "COMPOSING":
        return tuple(m for m, cells in declared().items() if cells is None)
    raise AttributeError(name)


def channel_kind(channel: Any) -> str:
    """``channel``'s row in this table: the ``kind`` it declares (``LossChannel.kind``; a policy channel's row is
    ``policy:<loss_type>``). A channel that declares none (written before 0.2.3) is read from its inputs, with a
    :class:`~composer_plugins.core.errors.PluginDeprecationWarning` naming the ``kind`` to declare (until 0.3.0)."""
    kind = getattr(channel, "kind", None)
    if kind is None:
        kind = _inferred_kind(channel)
        if kind != "custom":
            import warnings

            from composer_plugins.core.errors import PluginDeprecationWarning

            warnings.warn(
                f"loss channel {type(channel).__qualname__} declares no kind; it reads as {kind!r}: declare "
                f"`kind = {kind!r}` on the class (read from its inputs until 0.3.0)",
                PluginDeprecationWarning,
                stacklevel=2,
            )
    loss_type = getattr(channel, "loss_type", None)
    return f"policy:{loss_type}" if kind == "policy" and isinstance(loss_type, str) else kind


def _inferred_kind(channel: Any) -> str:
    from composer_plugins.training.step.assemble import PAIR_INPUTS

    declared = set(channel.required_inputs()) | {k for grp in channel.input_options for k in grp}
    if channel.needs_teacher:
        return "hint"
    if "teacher_scores" in declared:
        return "teacher"
    if declared & set(PAIR_INPUTS):
        return "pairs"
    if isinstance(getattr(channel, "loss_type", None), str) and {"advantages", "completion_mask"} <= declared:
        return "policy"
    return "custom"


def cell(mode: str, channel: Any, support: Mapping[str, Any] | None = None) -> Cell:
    """The cell of ``channel`` (a built channel, or its kind from :func:`channel_kind`) in ``mode``; ``support``: the
    declaring backend's own cells (a backend checking itself, whatever registry the caller built it from)."""
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.core.plugins import get_registry

    backend = mode.split(":", 1)[0]
    entry = next((e for e in get_registry().entries("backends") if e.name == backend), None)
    modes = support if support is not None else _declared_by(entry) if entry is not None else {}
    if mode not in modes:
        raise ConfigError(f"unknown backend mode {mode!r}", key="mode", valid=list(declared()))
    kind = channel if isinstance(channel, str) else channel_kind(channel)
    cells = modes[mode]
    found = Cell(RUNS) if cells is None else cells.get(kind)
    if found is not None:
        return found
    if kind == ADVANTAGE:
        return Cell(REFUSED, f"{backend}'s loss reads the advantages its trainer computes, not a configured estimator")
    return Cell(REFUSED, f"{backend} runs only the losses it re-implements, not a channel object")


def _elsewhere(kind: str, mode: str) -> list[str]:
    """The other modes where ``kind`` runs (``runs`` first, then ``limits``)."""
    others = [m for m in declared() if m != mode]
    full = [m for m in others if cell(m, kind).status == RUNS]
    return full + [m for m in others if cell(m, kind).status == LIMITS]


def _mode_words(mode: str) -> str:
    backend, _, sub = mode.partition(":")
    return f"the {backend} backend (mode={sub!r})" if sub else f"the {backend} backend"


def check_channels(
    mode: str, channels: Any, src: Any = None, support: Mapping[str, Any] | None = None
) -> list[tuple[str, Cell]]:
    """Refuse, at build time, a channel ``mode`` cannot run; return ``[(channel name, cell)]`` otherwise.

    ``channels``: a :class:`~composer_plugins.training.config.train.TrainConfig` (its enabled channels are built
    here, and an option of one that the mode does not carry, set to other than its default, is refused
    too), or already built channels (their names are their ``losses.<key>``).
    ``src``: the :class:`~composer_plugins.core.config.Config` the error is located in (file and line).
    The error names the channel, the mode, why, and the modes that run it.
    """
    from composer_plugins.core.config import Config

    src = src if src is not None else Config()
    options: dict[str, dict[str, Any]] = {}
    if not isinstance(channels, Sequence):
        from composer_plugins.training.step.components import build_channels

        options = {spec.key: dict(spec.options) for spec in channels.channels}
        channels = build_channels(channels, src)
    out: list[tuple[str, Cell]] = []
    for ch in channels:
        if getattr(ch, "weight", 1.0) == 0.0:
            continue
        kind = channel_kind(ch)
        c = cell(mode, kind, support)
        fix = "(docs/backends.md, 'Which channel runs where')."
        if not c.runs:
            where = _elsewhere(kind, mode)
            instead = ", ".join(_label(m) for m in where) if where else "no installed backend"
            raise src.error(
                f"losses.{ch.name}",
                f"channel {ch.name!r} ({kind}) cannot run in {_mode_words(mode)}: {c.note}. It runs in: {instead} "
                f"— disable it here (`enabled: false`) or pick one of those {fix}",
            )
        for opt, value in options.get(ch.name, {}).items():
            a = cell(mode, ADVANTAGE, support) if opt == ADVANTAGE else None
            if a is not None and not a.runs:
                raise src.error(
                    f"losses.{ch.name}.{opt}",
                    f"{_mode_words(mode)} cannot honour channel {ch.name!r}'s advantage estimator ({a.note}); remove "
                    f"it (the group default) or run it in: {', '.join(map(_label, _elsewhere(ADVANTAGE, mode)))} {fix}",
                )
            if a is not None:
                continue
            default = _default(ch, opt)
            if c.carries is None or opt in c.carries or opt in NEUTRAL_OPTIONS or value == default:
                continue
            raise src.error(
                f"losses.{ch.name}.{opt}",
                f"{_mode_words(mode)} does not carry this option of channel {ch.name!r} ({c.note}); remove it "
                f"(default: {default!r}) or run the channel as configured in: {_as_configured(kind, mode)} {fix}",
            )
        out.append((ch.name, c))
    return out


def _as_configured(kind: str, mode: str) -> str:
    """The other modes that carry every option of a ``kind`` channel."""
    modes = [m for m in declared() if m != mode]
    return ", ".join(_label(m) for m in modes if cell(m, kind).runs and cell(m, kind).carries is None)


def _default(channel: Any, option: str) -> Any:
    """The default of ``option`` in the channel's constructor (``inspect.Parameter.empty`` when it has none)."""
    import inspect

    param = inspect.signature(type(channel).__init__).parameters.get(option)
    return inspect.Parameter.empty if param is None else param.default


def _label(mode: str) -> str:
    backend, _, sub = mode.partition(":")
    return f"{backend} (mode={sub})" if sub else backend


def builtin_channels() -> dict[str, Any]:
    """``{registry name: channel built with its defaults}`` for the losses the core distribution registers."""
    from composer_plugins.core.plugins import get_registry

    reg = get_registry()
    return {e.name: e.build() for e in reg.entries("losses") if e.distribution == "composer-plugins"}


def support_table(channels: Mapping[str, Any] | None = None) -> dict[str, dict[str, Cell]]:
    """``{channel name: {mode: Cell}}`` for ``channels`` (default: the built-in ones, then the estimator row)."""
    chans = builtin_channels() if channels is None else channels
    modes = tuple(declared())
    table = {name: {m: cell(m, ch) for m in modes} for name, ch in chans.items()}
    if channels is None:  # the built-in table's last row: a channel's configured advantage estimator
        table[f"losses.<key>.{ADVANTAGE}"] = {m: cell(m, ADVANTAGE) for m in modes}
    return table


def markdown_table(channels: Mapping[str, Any] | None = None) -> str:
    """The table of ``docs/backends.md``: one row per channel, one column per mode, then the notes.

    ``limits`` and ``refused`` cells carry a note number; each note is listed once, under the table.
    """
    table = support_table(channels)
    modes = tuple(declared())
    notes: list[str] = []

    def mark(c: Cell) -> str:
        if c.status == RUNS:
            return "runs"
        if c.note not in notes:
            notes.append(c.note)
        return f"{c.status} [{notes.index(c.note) + 1}]"

    head = "| channel | " + " | ".join(_label(m) for m in modes) + " |"
    rule = "|---|" + "---|" * len(modes)
    rows = [f"| `{name}` | " + " | ".join(mark(row[m]) for m in modes) + " |" for name, row in table.items()]
    listed = [f"{i}. {n}." for i, n in enumerate(notes, 1)]
    return "\n".join([head, rule, *rows, "", *listed]) + "\n"
