"""Policy models: the embedded tiny default, tokenizer training, generation and log-prob utilities.

Importing this package does not import torch (the config reads :data:`CompileMode` when it loads).
"""

from typing import Literal, get_args

#: ``rollout.compile`` (the one list of its values): a static KV cache and a compiled decode step.
CompileMode = Literal["auto", "on", "off"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
