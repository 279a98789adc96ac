"""One dvc.yaml's plots and only its: an HTML page that renders offline and one SVG per plot beside it.

Why :func:`render` names one file's targets (:func:`targets`) and bundles vega inline (:func:`offline_template`)
instead of a bare ``dvc plots show``: docs/pipeline.md, "Plots".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from composer_plugins.core.errors import ConfigError

#: The vega-lite version of the bundle and the SVGs: DVC's templates are vega-lite v5 specs.
VEGA_LITE = "5.21"
TEMPLATE_NAME = ".offline_template.html"

_PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {{refresh_tag}}
    <title>{title}</title>
    <!-- vega, vega-lite {vl} and vega-embed bundled by vl-convert-python {vlc}: no network needed -->
    <script>{bundle}</script>
    <style>
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def plot_ids(dvc_file: str | Path = "dvc.yaml") -> list[str]:
    """The ids of the top-level ``plots`` of ``dvc_file``, in file order (a path, or a titled plot's name)."""
    p = Path(dvc_file)
    if not p.is_file():
        raise ConfigError(f"no {p.name} here: run this where the pipeline's dvc.yaml is (or pass --dvc-file).")
    plots = (yaml.safe_load(p.read_text()) or {}).get("plots") or []
    ids: list[str] = []
    for entry in plots:
        if isinstance(entry, str):
            ids.append(entry)
        elif isinstance(entry, dict):
            ids += [str(k) for k in entry]
    return ids


def targets(dvc_file: str | Path = "dvc.yaml") -> list[str]:
    """``<dvc_file>::<id>`` for each plot of ``dvc_file``, as the regular expressions DVC matches targets with
    (``re.match`` on ``<config file>::<id>``): escaped and anchored, so they name these plots and no other
    dvc.yaml's (a plain ``plots/curves`` also matches ``studies/x/dvc.yaml``'s plot of that id)."""
    return [_literal(f"{Path(dvc_file).as_posix()}::{i}") + "$" for i in plot_ids(dvc_file)]


def _literal(text: str) -> str:
    """``text`` as a regular expression matching itself, without backslashes (DVC turns a target's ``\\`` into
    ``/`` as if it were a Windows path): each special character in a one-character class (``.`` -> ``[.]``)."""
    return "".join("." if c in "[]" else f"[{c}]" if c in ".$*+?{}()|" else c for c in text)


def offline_template(path: str | Path, title: str = "composer-plugins plots") -> Path:
    """Write (once per vl-convert version) DVC's HTML template with vega, vega-lite and vega-embed inline; it has
    no ``{scripts}`` placeholder, so DVC's CDN ``<script src>`` tags are never added."""
    try:
        import vl_convert as vlc
    except ImportError as e:  # pragma: no cover - the dvc extra installs it
        raise ConfigError(
            "offline plots need vl-convert-python (it bundles vega): pip install 'composer-plugins[dvc]'"
        ) from e
    out = Path(path)
    stamp = f"vega-lite {VEGA_LITE} and vega-embed bundled by vl-convert-python {vlc.__version__}"
    if out.is_file() and stamp in out.read_text(encoding="utf8"):
        return out
    bundle = vlc.javascript_bundle(vl_version=VEGA_LITE).replace("</script", "<\\/script")
    page = _PAGE.format(title=title, vl=VEGA_LITE, vlc=vlc.__version__, bundle=bundle)  # DVC fills the {{...}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf8")
    return out


def _dvc(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}  # no analytics daemon outliving the call
    return subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=True, text=True, check=False, env=env)


def svg_name(plot_id: str) -> str:
    """A file name for a plot id (``plots/curves/train.reward.csv`` -> ``plots_curves_train.reward.csv.svg``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", plot_id).strip("_") + ".svg"


def _describe(err: Any) -> str:
    """One line of a DVC plot error (``{name, source, type, msg}``)."""
    if not isinstance(err, dict):
        return str(err)
    msg = str(err.get("msg", "")).splitlines()[0] if err.get("msg") else err.get("type", "error")
    src = f" ({err['source']})" if err.get("source") and err.get("source") != err.get("name") else ""
    return f"{err.get('name')}{src}: {msg}"


def render(dvc_file: str | Path = "dvc.yaml", out: str | Path = "dvc_plots", svg: bool = True) -> dict[str, Any]:
    """Render the plots of ``dvc_file`` alone into ``out``: ``index.html`` (offline) and, with ``svg``, one SVG each.

    Returns ``{"html": path, "plots": [ids rendered], "svgs": [paths], "errors": [DVC's messages]}``.
    """
    tg = targets(dvc_file)
    if not tg:
        raise ConfigError(f"{dvc_file} defines no plots.")
    out = Path(out)
    tpl = offline_template(out / TEMPLATE_NAME)
    shown = _dvc("plots", "show", *tg, "--json")
    try:
        data = json.loads(shown.stdout)
    except json.JSONDecodeError as e:
        raise ConfigError(f"`dvc plots show --json` failed: {(shown.stderr or shown.stdout).strip()}") from e
    plots = {k: v for k, v in (data.get("data") or {}).items() if v}
    errors = [_describe(e) for e in data.get("errors") or []]
    if not plots:
        raise ConfigError(f"none of the plots of {dvc_file} has data yet: run `dvc repro` first.")
    res = _dvc("plots", "show", *tg, "--html-template", str(tpl), "-o", str(out))
    if res.returncode != 0 or not (out / "index.html").is_file():
        raise ConfigError(f"`dvc plots show` failed: {(res.stderr or res.stdout).strip()}")
    svgs: list[str] = []
    if svg:
        import vl_convert as vlc

        for pid, entries in plots.items():
            for i, entry in enumerate(e for e in entries if e.get("type") == "vega"):
                name = svg_name(pid if i == 0 else f"{pid}_{i}")
                (out / name).write_text(vlc.vegalite_to_svg(entry["content"], vl_version=VEGA_LITE), encoding="utf8")
                svgs.append((out / name).as_posix())
    return {"html": (out / "index.html").as_posix(), "plots": list(plots), "svgs": svgs, "errors": errors}
