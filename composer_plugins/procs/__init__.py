"""Child processes that cannot hang their parent and do not outlive it (Linux-first, stdlib only).

A package of its own below every package that starts children (the code sandbox of ``envs``, the DiLoCo
launcher), beside the plugin kernel and importing nothing but the stdlib; the benchmarks and the tests use it
too. Its modules, each piece documented where it is defined:

* :mod:`.lifetime`: :func:`die_with_parent` / :func:`set_pdeathsig` (``PR_SET_PDEATHSIG``: a child dies with
  the thread that started it, even after a SIGKILL);
* :mod:`.table`: process tags and the process table (:func:`tag_env`, :func:`tagged_pids`, :func:`kill_tree`:
  found and killed even after ``setsid`` or re-parenting);
* :mod:`.children`: :class:`Children` (named children whose wait fails at once on the first failure, naming
  it, bounds every wait and asks a stuck child for its stacks) and :func:`run` (``subprocess.run`` whose
  timeout and interruption kill the whole tree);
* :mod:`.status`: :func:`waiting_for` (what this process is blocked on, for a supervisor that times out).
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
