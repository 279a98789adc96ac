"""``teacher_distill`` with no teacher is refused when the config loads, at its line, with the fix (issue 51): it
was accepted, and every step then distilled nothing (loss 0, ``skipped = 1``) without an error or a warning."""

from __future__ import annotations

import textwrap

import pytest

from composer_plugins.core.errors import ConfigError
from composer_plugins.losses.teacher_distill import TeacherDistillChannel
from composer_plugins.training.config.train import load_train_config


def test_teachers_empty_is_refused_at_its_line(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(
        textwrap.dedent(
            """
            losses:
              grpo: {weight: 1.0}
              teacher_distill:
                weight: 0.5
                teachers: []
            """
        ).lstrip()
    )
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    msg = str(e.value)
    assert f"{p}:5" in msg and "losses.teacher_distill.teachers" in msg
    assert "at least one teacher" in msg and "HINT" in msg and "enabled: false" in msg
    # the same entry turned off loads; a channel built by hand is refused the same way
    p.write_text(p.read_text().replace("weight: 0.5", "enabled: false"))
    load_train_config(p)
    with pytest.raises(ValueError, match="teachers: .*at least one teacher"):
        TeacherDistillChannel(teachers=[])
    TeacherDistillChannel()  # no teachers: scores handed in by the trainer (PRIME-RL's teacher stream)
