"""The one progress switch: ``--no-progress`` (or ``COMPOSER_PROGRESS=0``) silences every bar.

Commands call :func:`silence` for ``--no-progress``; it sets ``COMPOSER_PROGRESS=0`` (read by
:func:`enabled`, so training, SFT and evaluation draw no bar) and the switches of the libraries
that draw their own: Hugging Face Hub and transformers ("Loading weights", downloads), tqdm itself
(``TQDM_DISABLE``) and MLflow's artifact upload bar. Child processes (DVC stages, DiLoCo replicas)
inherit them through the environment. Nothing here imports those libraries.
"""

from __future__ import annotations

import os
import sys

#: Environment variable of the switch: ``0``/``false``/``no``/``off`` turn every progress bar off.
ENV = "COMPOSER_PROGRESS"

_OFF = ("0", "false", "no", "off")


def enabled(configured: bool = True) -> bool:
    """Whether to draw a bar: the config's own setting, unless the switch is off."""
    return bool(configured) and os.environ.get(ENV, "").strip().lower() not in _OFF


def silence() -> None:
    """Turn every progress bar off for this process and its children."""
    os.environ[ENV] = "0"
    os.environ["TQDM_DISABLE"] = "1"
    quiet_libraries()


def quiet_libraries() -> None:
    """Turn off the bars the libraries draw on their own (transformers' "Loading weights", Hub downloads, MLflow
    uploads), for this process and its children, leaving the project's own bar and progress lines alone.

    What a run whose bar is off in its config does (``trainer.enable_progress_bar: false``, the DVC stages):
    a library's bar would otherwise be the only one left, in the middle of a log.
    """
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hasattr(hub, "disable_progress_bars"):
        hub.disable_progress_bars()
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None and hasattr(tf_logging, "disable_progress_bar"):
        tf_logging.disable_progress_bar()
