"""``benchmarks/mutation.py``: which mutants it makes, how it samples and scores, and one real run end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks import mutation as M


def test_annotations_are_not_mutated_and_the_rest_is(tmp_path):
    src = tmp_path / "composer_plugins" / "m.py"
    src.parent.mkdir()
    src.write_text(
        "from __future__ import annotations\n"
        "def f(a: int | None = 1 + 2, *, b: list[int] | None = None) -> int | None:\n"
        "    x: int | None = a\n"
        "    y = x | 4\n"
        "    return y\n"
    )
    group = M.Group("g", files=("m.py",), tests=(), target=0.0)
    muts = M.enumerate_mutants(group, root=tmp_path)
    lines = {m.line for m in muts}
    # the default `1 + 2` and `x | 4` are mutated; no `|` of an annotation is
    assert any(m.operator.endswith("Add_Sub") for m in muts)
    bitor = [m for m in muts if "BitOr_" in m.operator]
    assert bitor and {m.line for m in bitor} == {4}
    assert len([m for m in bitor if m.operator.endswith("BitOr_BitAnd")]) == 1
    assert lines <= {2, 4}
    again = M.enumerate_mutants(group, root=tmp_path)
    assert [m.id for m in again] == [m.id for m in muts]
    orig, mutated = M.mutated_source(bitor[0], root=tmp_path)
    assert orig != mutated and "x | 4" not in mutated and mutated.count("int | None") == 3


def test_the_sample_is_deterministic_and_its_interval_is_wilsons():
    pop = [M.Mutant("g", "f.py", "core/X", i, i, None) for i in range(100)]
    a, b = M.sample(pop, 10, 1, "g"), M.sample(pop, 10, 1, "g")
    assert [m.occurrence for m in a] == [m.occurrence for m in b] and len(a) == 10
    assert [m.occurrence for m in M.sample(pop, 10, 2, "g")] != [m.occurrence for m in a]
    assert M.sample(pop, 0, 1, "g") == pop and M.sample(pop, 500, 1, "g") == pop
    lo, hi = M.wilson(34, 40)
    assert (round(lo, 1), round(hi, 1)) == (70.9, 92.9)
    assert M.wilson(40, 40)[1] == 100.0 and M.wilson(0, 0) == (0.0, 100.0)


def test_unknown_groups_and_files_are_refused_with_the_names_that_exist():
    with pytest.raises(SystemExit, match="unknown group 'kernel'.*Did you mean 'kernels'"):
        M.main(["--only", "kernel", "--list"])
    with pytest.raises(SystemExit, match="not a mutated file; the files are: .*losses/taid.py"):
        M.main(["--show", "losses/nope.py:core/NumberReplacer:0"])


@pytest.mark.slow
def test_one_mutant_runs_end_to_end(tmp_path):
    """A mutant the losses' tests must kill, run as the README says, and the report it lands in."""
    import subprocess
    import sys

    kill = "losses/correction.py:core/ReplaceUnaryOperator_USub_Invert:1"  # -inf -> ~inf: a TypeError
    out = tmp_path / "mut"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.mutation", "--mutant", kill, "--jobs", "1", "--out", str(out)],
        cwd=M.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    g = report["groups"]["losses"]
    assert g["total"] == 1 and g["killed"] == 1 and g["score_pct"] == 100.0
    assert g["mutants"][0]["id"] == kill and g["mutants"][0]["outcome"] == "killed"
    assert "| losses |" in out.with_suffix(".md").read_text()
    assert f"[losses 1/1] killed   {kill}" in res.stdout
