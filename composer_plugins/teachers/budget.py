"""The dollar ceiling of a replay run.

A paid call's worst-case cost is *reserved* before it is sent (refused when it would pass the ceiling); when
the call ends the reservation becomes its cost (``settle``), is dropped (``release``: provably not billed) or
stays as *uncertain* spend (``mark_uncertain``: may have been billed). So ``spent + uncertain + reserved <=
max_usd`` holds at every moment (docs/replay.md, "The replay engine").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Budget:
    """Running totals against an optional ceiling (``max_usd=None``: no ceiling, still accounted)."""

    max_usd: float | None = None
    spent_usd: float = 0.0
    uncertain_usd: float = 0.0
    reserved_usd: float = 0.0
    #: Set once a reservation has been refused (no new paid calls are started after that).
    exhausted: bool = False
    #: Calls whose actual cost exceeded their reservation (should stay 0; logged).
    overruns: int = 0
    #: Reservations currently held (calls in flight).
    in_flight: int = 0

    @property
    def committed_usd(self) -> float:
        """Spent, uncertain and reserved together: what the ceiling is checked against."""
        return self.spent_usd + self.uncertain_usd + self.reserved_usd

    def try_reserve(self, amount: float) -> bool:
        """Reserve ``amount``; ``False`` (and :attr:`exhausted`) when it would pass the ceiling."""
        amount = max(0.0, float(amount))
        if self.max_usd is not None and amount > 0 and self.committed_usd + amount > self.max_usd * (1 + 1e-12):
            self.exhausted = True
            return False
        self.reserved_usd += amount
        self.in_flight += 1
        return True

    def release(self, reserved: float) -> None:
        """Drop a reservation: the call provably cost nothing (the other endings call this first)."""
        self.in_flight = max(0, self.in_flight - 1)
        # exact zero when nothing is in flight, so float residue never blocks a reservation
        self.reserved_usd = max(0.0, self.reserved_usd - reserved) if self.in_flight else 0.0

    def settle(self, reserved: float, actual: float) -> None:
        """A reserved call completed and cost ``actual``."""
        self.release(reserved)
        self.spent_usd += actual
        if actual > reserved + 1e-12:
            self.overruns += 1
            log.warning("a call cost $%.6f, more than its worst-case reservation $%.6f", actual, reserved)

    def mark_uncertain(self, reserved: float) -> None:
        """A reserved call ended without an answer but may have been billed: keep its worst case."""
        self.release(reserved)
        self.uncertain_usd += reserved
