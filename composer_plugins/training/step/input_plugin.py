"""The built-in channel input builders' table (torch-free): :mod:`composer_plugins.training.runs.plugin` registers
each builder of :mod:`composer_plugins.training.step.input_builders` lazily under every input it provides."""

from __future__ import annotations

#: builder (in :mod:`composer_plugins.training.step.input_builders`) -> (the inputs it provides, one-line description);
#: tests/training/step/test_training_input_builders.py checks every assembler input is here once.
BUILTINS: dict[str, tuple[tuple[str, ...], str]] = {
    "record_fields": (
        (
            "completion_mask",
            "completion_ids",
            "advantages",
            "rewards",
            "num_generations",
            "group_index",
            "global_step",
            "total_steps",
            "sampling_temperature",
        ),
        "The record's masks, ids, rewards, advantages and group layout, the step meta and sampling temperature.",
    ),
    "policy_logprobs": (
        ("logprobs", "old_logprobs", "inference_logprobs", "importance_sampling_ratio"),
        "The policy's per-token log-probs (with grad, chunked from hidden states), sampling-time ones, IS ratio.",
    ),
    "reference_logprobs": (("ref_logprobs",), "The reference model's log-probs, as the experience maker made them."),
    "hint_inputs": (
        ("student_hidden", "teacher_hidden", "lm_head_weight", "teacher_lm_head_weight", "hint_mask", "hint_rows"),
        "Student and hinted-teacher hidden states on the hinted rows' completion tokens, and the LM head(s).",
    ),
    "hint_teacher_logprobs": (
        ("hint_teacher_logprobs",),
        "Sampled-token log-probs under the hint teacher on hinted rows, the policy's own elsewhere (PRIME-RL opsd).",
    ),
    "pair_inputs": (
        (
            "chosen_logps",
            "rejected_logps",
            "chosen_avg_logps",
            "rejected_avg_logps",
            "chosen_lengths",
            "rejected_lengths",
            "ref_chosen_logps",
            "ref_rejected_logps",
        ),
        "Sequence log-probs of the step's preference pairs: the policy's (with grad), the reference's.",
    ),
    "policy_hidden_states": (
        ("hidden_states",),
        "The policy's final hidden states at every completion position (with grad), shared with the log-probs.",
    ),
    "teacher_scores": (
        ("teacher_scores", "teacher_logprobs"),
        "The external teachers' top-k scores of the rows (futures awaited up to the deadline), packed.",
    ),
}
