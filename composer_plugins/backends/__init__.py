"""Backends of composer-plugins: the built-in ``lightning`` one and what every backend shares.

``lightning`` (the native path), ``base`` (the ``Backend`` class and its one local loop), ``rollout`` (what an
upstream backend reuses in process) and ``support`` (which channel runs in which mode). TRL, VeRL, PRIME-RL
and Monarch ship in their own ``composer-plugins-<backend>`` distributions: see docs/backends.md.
"""
