"""Child processes that cannot hang their parent and do not outlive it (Linux-first, stdlib only).

A package of its own below every package that starts children (the code sandbox of ``envs``, the DiLoCo
launcher), beside the plugin kernel and importing nothing but the stdlib. Its modules, each piece documented
where it is defined: :mod:`.lifetime` (:func:`die_with_parent`, :func:`set_pdeathsig`), :mod:`.table` (process
tags, :func:`tagged_pids`, :func:`kill_tree`), :mod:`.children` (:class:`Children`, :func:`run`) and
:mod:`.status` (:func:`waiting_for`).
"""

from __future__ import annotations

from .children import Child, ChildFailed, Children, exit_description, run, tail
from .lifetime import die_with_parent, set_pdeathsig
from .status import WAIT_STATUS_ENV, waiting_for
from .table import (
    TAG_ENV,
    ProcInfo,
    all_pids,
    descendants,
    describe,
    kill_tree,
    new_tag,
    proc_info,
    tag_env,
    tagged_pids,
)

__all__ = [
    "TAG_ENV",
    "WAIT_STATUS_ENV",
    "Child",
    "ChildFailed",
    "Children",
    "ProcInfo",
    "all_pids",
    "descendants",
    "describe",
    "die_with_parent",
    "exit_description",
    "kill_tree",
    "new_tag",
    "proc_info",
    "run",
    "set_pdeathsig",
    "tag_env",
    "tagged_pids",
    "tail",
    "waiting_for",
]
