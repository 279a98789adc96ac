"""The distribution's version, in the kernel so that the kernel's own modules can read it without importing the
package root (which imports them: a circle)."""

from __future__ import annotations

__version__ = "0.1.0"
