"""The confirmatory study's power table (README.md, "Power"), written before any study cell ran.

The report's test (``study.blocking: random_start``, ``pipeline.stats.crossed_effect``) has standard error
``sqrt(s_start**2 / k + v_problem / (k * n))`` for ``k`` warm starts of one RL seed each and ``n`` held-out
problems: ``s_start`` is the SD of an effect across starts, ``v_problem`` the variance of one start's
per-problem difference (about the share of problems on which the two arms disagree). Holm over ``m`` tests (18: six
channels, the control's two pooled tests and its two tests within each of the five starts) puts the most
stringent one at two-sided level ``alpha / m``. For each setting the first table gives the half-width of that
test's interval and the smallest effect it calls *helps* with 80 % power; a test is *equivalent within ±delta*
only where its half-width is under ``delta``. The second table is the control within one start
(``study.control: each_start``): the problems are the sample, ``se = sqrt(v_problem / n)``, and the bar is
cleared where the effect minus the half-width is at least the bar.

    python power.py             # the table in README.md
"""

from __future__ import annotations

import math

from scipy.stats import t

ALPHA, M, N, DELTA = 0.05, 18, 400, 0.03


def row(k: int, s_start: float, v_problem: float) -> tuple[float, float]:
    se = math.sqrt(s_start**2 / k + v_problem / (k * N))
    crit = t.ppf(1 - ALPHA / M / 2, k - 1)
    return crit * se, (crit + t.ppf(0.8, k - 1)) * se


def main() -> None:
    print(f"| starts k | SD across starts | disagreeing problems | half-width at α/{M} | effect for 80 % power |")
    print("|---|---|---|---|---|")
    for k in (3, 5, 8):
        for s_start in (0.005, 0.02, 0.06):
            for v in (0.05, 0.30):
                h, mde = row(k, s_start, v)
                print(f"| {k} | {s_start:.3f} | {v:.2f} | ±{h:.3f} | {mde:.3f} |")
    print()
    print(f"| within one start: disagreeing problems | half-width at α/{M} | effect that clears +0.10 | clears +0.05 |")
    print("|---|---|---|---|")
    for v in (0.10, 0.20, 0.30, 0.45):
        h = t.ppf(1 - ALPHA / M / 2, N - 1) * math.sqrt(v / N)
        print(f"| {v:.2f} | ±{h:.3f} | {0.10 + h:.3f} | {0.05 + h:.3f} |")


if __name__ == "__main__":
    main()
