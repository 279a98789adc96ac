"""Default plugin: registers the built-in losses and advantage estimators through the public hooks.

Factories are lazy ``"module:attr"`` strings, so listing the channels never imports torch.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl

_POLICY = "composer_plugins.losses.policy:PolicyLossChannel"
_ADV = "composer_plugins.losses.advantages"

#: name -> one-line description of each clipped policy-gradient channel.
POLICY_CHANNELS: dict[str, str] = {
    "grpo": "GRPO clipped PG: per-sequence token mean, then batch mean (TRL).",
    "bnpo": "BNPO clipped PG, normalised by the local batch's tokens (TRL).",
    "dr_grpo": "Dr. GRPO clipped PG, normalised by B × max_completion_length (TRL).",
    "dapo": "DAPO clip-higher PG, normalised by the global token count (TRL).",
    "cispo": "CISPO: stop-grad clipped IS weight × A × log-prob (MiniMax-M1, TRL).",
    "gspo": "GSPO: sequence-level importance ratio, GRPO aggregation (TRL).",
}


@hookimpl
def register_loss_channels(register: Any) -> None:
    """Register the built-in losses."""
    for name, description in POLICY_CHANNELS.items():
        register(name, _POLICY, description=description, loss_type=name)
    register(
        "dppo",
        "composer_plugins.losses.policy:DPPOChannel",
        description="PRIME-RL default: DPPO trust-region mask, IS-weighted PG + KL.",
    )
    register(
        "hint_distill",
        "composer_plugins.losses.distill:HintDistillChannel",
        description="Hint self-distillation on hinted-turn tokens: jsd|taid|entropy_opd.",
    )
    register(
        "teacher_distill",
        "composer_plugins.losses.teacher_distill:TeacherDistillChannel",
        description="On-policy distillation from N external teachers' top-k log-probs: reverse_kl|forward_kl|jsd.",
    )
    register(
        "replay_dpo",
        "composer_plugins.losses.preference:ReplayPreferenceChannel",
        description="Replay DPO (sigmoid|ipo|hinge, TRL) or SimPO on chosen/rejected.",
        method="dpo",
    )
    register(
        "replay_simpo",
        "composer_plugins.losses.preference:ReplayPreferenceChannel",
        description="Replay SimPO on chosen/rejected pairs (princeton-nlp/SimPO).",
        method="simpo",
    )


@hookimpl
def register_advantage_estimators(register: Any) -> None:
    """Register the built-in advantage estimators."""
    register("group", f"{_ADV}:GroupAdvantage", description="GRPO: r - mean(group), ÷ std (scale: group|batch|none).")
    register("rloo", f"{_ADV}:RLOOAdvantage", description="RLOO: r - mean of the siblings (scale: none|batch).")
