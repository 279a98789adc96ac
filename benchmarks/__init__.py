"""Benchmarks of composer-plugins: ``benchmarks/bench_<area>.py`` modules and the ``run_all`` harness.

Every ``bench_<area>`` module exposes ``run(quick: bool = False) -> dict`` returning
``{"name", "results", "ratios", "targets"}``; ratios are measured against a baseline in
the same run. ``python -m benchmarks.run_all [--quick]`` runs them all.
"""
