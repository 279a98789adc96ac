"""``sft.slip_rate``: a careless demonstrator's warm start (the column levels' dropped carry)."""

from __future__ import annotations

import pytest


def test_dropped_carry_drops_only_the_last_columns_carry():
    from composer_plugins.envs.arith import dropped_carry, generate_problems

    sol = "6+9+0=15\n5+8+1=14\n4+7+1=12\n#### 1245"
    assert dropped_carry(sol) == "6+9+0=15\n5+8+1=14\n4+7+1=12\n#### 245"
    assert dropped_carry("1+2+0=3\n2+3+0=5\n#### 53") is None  # the last column does not carry
    assert dropped_carry("Tom has 3 apples.\n#### 3") is None  # not a column solution
    assert dropped_carry("#### 12") is None
    problems = generate_problems(300, "long_columns", seed=5, split="train")
    slipped = [(p, dropped_carry(p.solution)) for p in problems]
    carry = [(p, s) for p, s in slipped if s is not None]
    assert 0.4 < len(carry) / len(problems) < 0.8  # most 3- to 5-digit sums carry out of their last column
    for p, s in carry:  # every column line kept, the answer off by exactly the dropped carry
        assert s.split("\n")[:-1] == p.solution.split("\n")[:-1]
        assert int(s.rsplit("#### ", 1)[1]) == p.answer - 10 ** (len(str(p.answer)) - 1)
    assert all(p.answer < 10 ** len(str(p.question.split()[1])) for p, s in slipped if s is None)


def test_sft_slip_rate_slips_plain_carry_rows_only(make_cfg):
    from composer_plugins.envs.arith import dropped_carry
    from composer_plugins.training.runs.sft import sft_pairs
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import sft_cache_key

    base = ("", "env.difficulty=long_columns", "sft.num_examples=400")
    clean_cfg, src = make_cfg(*base)
    env = build_env(clean_cfg, src)
    clean = sft_pairs(env, clean_cfg)
    cfg, _ = make_cfg(*base, "sft.slip_rate=0.7")
    slipped = sft_pairs(env, cfg)
    assert [p for p, _ in slipped] == [p for p, _ in clean]  # the same prompts, hinted or not
    hinted = [i for i, (p, _) in enumerate(clean) if "Hint:" in p]
    assert hinted and all(slipped[i] == clean[i] for i in hinted)  # hinted demonstrations stay correct
    can = [i for i, (p, t) in enumerate(clean) if i not in hinted and dropped_carry(t) is not None]
    changed = [i for i in range(len(clean)) if slipped[i] != clean[i]]
    assert set(changed) <= set(can)
    assert all(slipped[i][1] == dropped_carry(clean[i][1]) for i in changed)
    assert 0.55 < len(changed) / len(can) < 0.85  # about slip_rate of the rows that can slip
    assert sft_pairs(env, cfg) == slipped  # deterministic in sft.seed
    # a new warm start in the cache; 0 keeps the key (and the cached warm starts) from before the option
    assert sft_cache_key(cfg, "b")["sft"]["slip_rate"] == 0.7
    assert "slip_rate" not in sft_cache_key(clean_cfg, "b")["sft"]


def test_sft_slip_rate_errors_are_located(make_cfg):
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.training.runs.sft import sft_pairs
    from composer_plugins.training.step.components import build_env

    with pytest.raises(ConfigError, match=r"sft\.slip_rate: a share must be in \[0, 1\]"):
        make_cfg("", "sft.slip_rate=1.5")
    cfg, src = make_cfg("", "env.difficulty=trivial", "sft.num_examples=20", "sft.slip_rate=0.5")
    with pytest.raises(ConfigError, match=r"sft\.slip_rate.*column levels' dropped carry.*sft\.slip_rate=0"):
        sft_pairs(build_env(cfg, src), cfg)
