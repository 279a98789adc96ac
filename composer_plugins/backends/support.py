"""Which loss channel runs in which backend mode: the one declaration, checked when a backend is built.

A backend mode either *composes* channels (the channel objects themselves run, on inputs built by the one
assembler: ``lightning``, ``trl``, ``monarch``) or *re-implements* a fixed set of losses inside an upstream
loss contract (``verl`` in both modes: VeRL's ``ppo_loss`` with a registered ``composer_<type>`` policy loss;
``prime_rl`` in both modes: PRIME-RL's per-sample ``loss_fn``). What a channel is, for this table, is read
from what it declares, never from its registry name (:func:`channel_kind`):

* ``hint``: it needs a teacher forward pass (``needs_teacher``: hint self-distillation);
* ``teacher``: it reads ``teacher_scores`` (external teachers' top-k log-probs);
* ``pairs``: it reads chosen/rejected pair log-probs (``PAIR_INPUTS``: replay DPO / SimPO);
* ``policy:<type>``: a policy-gradient channel of that loss type (``loss_type``; the DPPO+KL channel is ``dppo``);
* ``custom``: anything else (a third-party channel): it runs where channels are composed, and nowhere else.

Each cell is ``runs`` (the channel as it is), ``limits`` (it runs, as a narrower loss: the note says what
differs) or ``refused`` (the note says why and where it runs instead). A refused channel is refused when the
backend is built (:func:`check_channels`, a :class:`~composer_plugins.core.errors.ConfigError` located at
``losses.<key>``, naming the mode and the modes that run it), never dropped during the run.
``docs/backends.md`` holds :func:`markdown_table` of the built-in channels; a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMPOSING",
    "MODES",
    "NEUTRAL_OPTIONS",
    "Cell",
    "builtin_channels",
    "cell",
    "channel_kind",
    "check_channels",
    "markdown_table",
    "support_table",
]

RUNS, LIMITS, REFUSED = "runs", "limits", "refused"

#: Backend modes, in table order: ``backend`` or ``backend:mode`` (the backend's own ``mode=`` values).
MODES: tuple[str, ...] = (
    "lightning",
    "trl",
    "verl:local",
    "verl:ray",
    "prime_rl:local",
    "prime_rl:prime-rl",
    "monarch",
)
#: The modes that run the channel objects themselves (assembler + ``ChannelComposer``).
COMPOSING: tuple[str, ...] = ("lightning", "trl", "monarch")
#: Column headers of the table.
LABELS: dict[str, str] = {
    "lightning": "lightning",
    "trl": "trl",
    "verl:local": "verl local",
    "verl:ray": "verl upstream (`ray`)",
    "prime_rl:local": "prime_rl local",
    "prime_rl:prime-rl": "prime_rl upstream (`prime-rl`)",
    "monarch": "monarch",
}


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


_COMPOSED = "elsewhere (lightning, trl, monarch)"
#: Options no mode needs to carry: they name the channel or size its chunks, they do not change its loss.
NEUTRAL_OPTIONS = frozenset({"chunk_size", "label", "loss_type", "name"})
_CLIP = frozenset({"epsilon_low", "epsilon_high", "dppo_mask_low", "dppo_mask_high"})
_VERL_POLICY = Cell(
    LIMITS,
    "VeRL's `ppo_loss` with the registered `composer_<type>` loss, aggregated by VeRL's `agg_loss` "
    "(`loss_agg_mode`); of the channel's options only the clip range is carried (`beta`, `delta`, `rows` ... "
    "are refused: VeRL's `use_kl_loss` and entropy settings apply); one policy channel per run",
    _CLIP,
)
_VERL_OTHER = (
    "VeRL's actor runs one registered policy loss on (old, new) log-probs, advantages and a response mask; "
    "it has no hinted teacher, external teacher scores, preference pairs or channel object to feed"
)
_PRIME_SUM = (
    "the sample's token sum ÷ PRIME-RL's loss-token count; of the channel's options only the clip range is "
    "carried (`beta`, `delta`, `rows` ... are refused); one policy channel per run"
)
_PRIME_REFUSED_POLICY = (
    "its normaliser (per-sequence mean, local batch tokens or B × max length) does not fit PRIME-RL's "
    "per-sample token sum ÷ global token count; use `dapo`, `cispo`, `gspo` or `dppo` here"
)
_PRIME_NO_PAIRS = "PRIME-RL's per-sample log-prob contract carries no chosen/rejected pairs"
_PRIME_UPSTREAM_REF = (
    "at PRIME-RL 559b447 a sample carries `ref_logprobs` only under `orchestrator.algo` `opsd`/`opd`, which "
    "route the sampled tokens to PRIME-RL's own `ref_kl` loss, never to the custom loss; run it with "
    "mode='local' (sampled-token form), or with PRIME-RL's own `{algo}` algorithm (its loss, not this channel)"
)

#: The re-implementing modes: channel kind -> cell. A kind not listed is refused (``_refusal``).
_DECLARED: dict[str, dict[str, Cell]] = {
    "verl:local": {
        **{f"policy:{t}": _VERL_POLICY for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "dppo")},
        "hint": Cell(REFUSED, _VERL_OTHER),
        "teacher": Cell(REFUSED, _VERL_OTHER),
        "pairs": Cell(REFUSED, _VERL_OTHER),
    },
    "verl:ray": {
        **{f"policy:{t}": _VERL_POLICY for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "dppo")},
        "hint": Cell(
            REFUSED,
            "VeRL's distillation losses see the teacher's sampled-token or top-k log-probs of the student's own "
            "prompt; the hint channel needs the policy conditioned on prompt + hint, with full logits",
        ),
        "teacher": Cell(REFUSED, _VERL_OTHER),
        "pairs": Cell(REFUSED, _VERL_OTHER),
    },
}
_PRIME_COMMON: dict[str, Cell] = {
    "policy:dppo": Cell(RUNS, "PRIME-RL's default loss (DPPO+KL), exactly", _CLIP | {"adv_tau", "kl_tau"}),
    "policy:dapo": Cell(LIMITS, _PRIME_SUM, _CLIP),
    "policy:cispo": Cell(LIMITS, _PRIME_SUM, _CLIP),
    "policy:gspo": Cell(LIMITS, "sequence-level ratio, but not GSPO's per-sequence mean: " + _PRIME_SUM, _CLIP),
    **{f"policy:{t}": Cell(REFUSED, _PRIME_REFUSED_POLICY) for t in ("grpo", "bnpo", "dr_grpo")},
    "pairs": Cell(REFUSED, _PRIME_NO_PAIRS),
}
_DECLARED["prime_rl:local"] = {
    **_PRIME_COMMON,
    "hint": Cell(
        LIMITS,
        "a sampled-token KL estimate (`k3`) against the policy scoring the hinted context (PRIME-RL's `opsd` "
        "stream), not the channel's full-vocabulary divergence (its options other than `teacher` and `ema_rate` "
        "are refused); not together with `teacher_distill`",
        frozenset({"teacher", "ema_rate"}),
    ),
    "teacher": Cell(
        LIMITS,
        "one teacher; each token a two-way distribution (the sampled token, the rest) from the teacher's "
        "log-prob of the sampled token, not its top-k (options other than `teachers`, `divergence`, `beta` and "
        "`deadline_s` are refused); not together with `hint_distill`",
        frozenset({"teachers", "divergence", "beta", "deadline_s"}),
    ),
}
_DECLARED["prime_rl:prime-rl"] = {
    **_PRIME_COMMON,
    "hint": Cell(REFUSED, _PRIME_UPSTREAM_REF.format(algo="opsd")),
    "teacher": Cell(REFUSED, _PRIME_UPSTREAM_REF.format(algo="opd")),
}


def channel_kind(channel: Any) -> str:
    """What ``channel`` is for this table, read from its declarations (see the module docstring)."""
    from composer_plugins.losses.policy import DPPOChannel
    from composer_plugins.training.assemble import PAIR_INPUTS

    declared = set(channel.required_inputs()) | {k for grp in channel.input_options for k in grp}
    if channel.needs_teacher:
        return "hint"
    if "teacher_scores" in declared:
        return "teacher"
    if declared & set(PAIR_INPUTS):
        return "pairs"
    loss_type = "dppo" if isinstance(channel, DPPOChannel) else getattr(channel, "loss_type", None)
    if isinstance(loss_type, str) and {"advantages", "completion_mask"} <= declared:
        return f"policy:{loss_type}"
    return "custom"


def cell(mode: str, channel: Any) -> Cell:
    """The cell of ``channel`` (a built channel, or its kind from :func:`channel_kind`) in ``mode``."""
    if mode not in MODES:
        from composer_plugins.core.errors import ConfigError

        raise ConfigError(f"unknown backend mode {mode!r}", key="mode", valid=list(MODES))
    kind = channel if isinstance(channel, str) else channel_kind(channel)
    if mode in COMPOSING:
        return Cell(RUNS)
    found = _DECLARED[mode].get(kind)
    if found is not None:
        return found
    return Cell(REFUSED, f"{_backend(mode)} runs only the losses it re-implements, not a channel object")


def _backend(mode: str) -> str:
    return mode.split(":", 1)[0]


def _elsewhere(kind: str, mode: str) -> list[str]:
    """The other modes where ``kind`` runs (``runs`` first, then ``limits``)."""
    others = [m for m in MODES if m != mode]
    full = [m for m in others if cell(m, kind).status == RUNS]
    return full + [m for m in others if cell(m, kind).status == LIMITS]


def _mode_words(mode: str) -> str:
    backend, _, sub = mode.partition(":")
    return f"the {backend} backend (mode={sub!r})" if sub else f"the {backend} backend"


def check_channels(mode: str, channels: Any, src: Any = None) -> list[tuple[str, Cell]]:
    """Refuse, at build time, a channel ``mode`` cannot run; return ``[(channel name, cell)]`` otherwise.

    ``channels``: a :class:`~composer_plugins.training.config.TrainConfig` (its enabled channels are built
    here, and an option of one that the mode does not carry, set to other than its default, is refused
    too), or already built channels (their names are their ``losses.<key>``).
    ``src``: the :class:`~composer_plugins.core.config.Config` the error is located in (file and line).
    The error names the channel, the mode, why, and the modes that run it.
    """
    from composer_plugins.core.config import Config

    src = src if src is not None else Config()
    options: dict[str, dict[str, Any]] = {}
    if not isinstance(channels, Sequence):
        from composer_plugins.training.builders import build_channels
        from composer_plugins.training.config import channel_spec

        options = {key: dict(channel_spec(key, spec, src)[3]) for key, spec in channels.losses.items()}
        channels = build_channels(channels, src)
    out: list[tuple[str, Cell]] = []
    for ch in channels:
        if getattr(ch, "weight", 1.0) == 0.0:
            continue
        kind = channel_kind(ch)
        c = cell(mode, kind)
        where = _elsewhere(kind, mode)
        instead = ", ".join(_label(m) for m in where) if where else "no built-in backend"
        fix = "(docs/backends.md, 'Which channel runs where')."
        if not c.runs:
            raise src.error(
                f"losses.{ch.name}",
                f"channel {ch.name!r} ({kind}) cannot run in {_mode_words(mode)}: {c.note}. It runs in: {instead} "
                f"— disable it here (`enabled: false`) or pick one of those {fix}",
            )
        for opt, value in options.get(ch.name, {}).items():
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
    return ", ".join(_label(m) for m in MODES if m != mode and cell(m, kind).runs and cell(m, kind).carries is None)


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
    """``{channel name: {mode: Cell}}`` for ``channels`` (default: the built-in ones)."""
    chans = builtin_channels() if channels is None else channels
    return {name: {m: cell(m, ch) for m in MODES} for name, ch in chans.items()}


def markdown_table(channels: Mapping[str, Any] | None = None) -> str:
    """The table of ``docs/backends.md``: one row per channel, one column per mode, then the notes.

    ``limits`` and ``refused`` cells carry a note number; each note is listed once, under the table.
    """
    table = support_table(channels)
    notes: list[str] = []

    def mark(c: Cell) -> str:
        if c.status == RUNS:
            return "runs"
        if c.note not in notes:
            notes.append(c.note)
        return f"{c.status} [{notes.index(c.note) + 1}]"

    head = "| channel | " + " | ".join(LABELS[m] for m in MODES) + " |"
    rule = "|---|" + "---|" * len(MODES)
    rows = [f"| `{name}` | " + " | ".join(mark(row[m]) for m in MODES) + " |" for name, row in table.items()]
    listed = [f"{i}. {n}." for i, n in enumerate(notes, 1)]
    return "\n".join([head, rule, *rows, "", *listed]) + "\n"
