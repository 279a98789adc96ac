"""What both outer-sync transports share (:mod:`.strategy`, :mod:`.objstore`), so both apply the same update: the
``diloco:`` config, who a replica is, the fragment split, the outer optimizer and the parameter digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from composer_plugins.core.config import Config, component_spec, from_dict
from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.core.registry import import_object
from composer_plugins.diloco import env as _env

if TYPE_CHECKING:  # torch is imported where it is used, so loading a config (and its errors) never waits for it
    import torch
    from torch import nn

# -- configuration ------------------------------------------------------------------------


@dataclasses.dataclass
class JobsConfig:
    """The ``diloco.jobs:`` section: how a cloud executor runs each replica (docs/diloco.md, "Configuration").

    Attributes:
        image: container image with composer-plugins installed (HF Jobs: needed; Modal: a registry image).
        pip: Modal, without ``image``: packages to install into ``debian_slim`` (neither: this project, from
            the local source).
        flavor, namespace: HF Jobs hardware flavor and namespace (default: the token's user).
        gpu, cpu, memory_mb, app_name: Modal resources (``gpu=None``: CPU) and app name.
        secrets: HF Jobs: environment variables sent as job secrets; Modal: names of Modal secrets to attach.
        env: environment variables forwarded as plain job environment (e.g. ``AWS_ENDPOINT_URL``).
        start_timeout_s: a job still not running after this long is cancelled and counted as failed.
    """

    image: str | None = None
    pip: list[str] = dataclasses.field(default_factory=list)
    flavor: str = "cpu-basic"
    gpu: str | None = None
    cpu: float | None = None
    memory_mb: int | None = None
    timeout_s: int = 3600
    secrets: list[str] = dataclasses.field(default_factory=list)
    env: list[str] = dataclasses.field(default_factory=list)
    namespace: str | None = None
    app_name: str = "composer-plugins-diloco"
    start_timeout_s: float = 900.0
    poll_s: float = 5.0

    def validate(self, src: Config | None = None, key: str = "diloco.jobs") -> JobsConfig:
        """Refuse values no executor can run with, located at ``key.<field>`` in ``src``."""
        src = src if src is not None else Config()
        for name in ("timeout_s", "start_timeout_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise src.error(f"{key}.{name}", f"must be > 0, got {getattr(self, name)}.")
        return self


@dataclasses.dataclass
class DiLoCoConfig:
    """The ``diloco:`` config section. Every field has a sensible default; each is described, with its default,
    in docs/diloco.md's table ("Configuration"), and :meth:`validate` refuses a bad value naming its key."""

    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_optimizer: dict[str, Any] | None = None
    num_fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_steps: int | None = None
    min_replica_size: int = 1
    lighthouse: str | None = None
    hostname: str = "localhost"
    store_host: str = _env.LOOPBACK
    timeout_s: float = 60.0
    quorum_timeout_s: float = 3600.0
    connect_timeout_s: float = 60.0
    init_sync: bool = True
    checkpoint_transport: Literal["pg", "http"] = "pg"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    sync_log: str | None = None
    stop_file: str | None = None
    use_bucketization: bool = False
    bucket_cap_mb: int | None = None
    max_retries: int | None = None
    barrier_timeout_s: float = 600.0
    rejoin_timeout_s: float = 600.0
    replicas: int | None = None
    log_param_hash: bool = True
    transport: str = "torchft"
    store: str | None = None
    compress: str = "none"
    round_timeout_s: float = 300.0
    store_retry_s: float = 120.0
    poll_s: float = 0.01
    poll_max_s: float = 1.0
    request_timeout_s: float = 30.0
    run_id: str | None = None
    keep_rounds: int = 2
    state_every: int = 1
    exact_every: int = 1
    overlap: int = 0
    jobs: dict[str, Any] | None = None

    def validate(self, src: Config | None = None, key: str = "diloco") -> DiLoCoConfig:
        """Check the values, the transport's own rules and the ``jobs:`` subsection; errors name the key (located
        in ``src``) and the fix."""
        cfg = src if src is not None else Config()

        def bad(field: str, msg: str) -> ConfigError:
            return cfg.error(f"{key}.{field}", msg)

        for name in ("sync_every", "num_fragments", "min_replica_size", "checkpoint_every", "state_every"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}.")
        if self.sync_every % self.num_fragments:
            raise bad(
                "num_fragments",
                f"sync_every ({self.sync_every}) must be a multiple of num_fragments ({self.num_fragments}).",
            )
        per = self.sync_every // self.num_fragments
        if not 0 <= self.fragment_sync_delay < per:
            raise bad(
                "fragment_sync_delay",
                f"must be in [0, sync_every/num_fragments = {per}), got {self.fragment_sync_delay}.",
            )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise bad("fragment_update_alpha", f"must be in [0, 1], got {self.fragment_update_alpha}.")
        if self.outer_steps is not None and self.outer_steps < 1:
            raise bad("outer_steps", f"must be >= 1, got {self.outer_steps}.")
        if self.rejoin_timeout_s < 0:
            raise bad("rejoin_timeout_s", f"must be >= 0, got {self.rejoin_timeout_s}.")
        if self.exact_every < 1 or isinstance(self.exact_every, bool):
            raise bad("exact_every", f"must be >= 1, got {self.exact_every!r}.")
        if self.overlap not in (0, 1) or isinstance(self.overlap, bool):
            raise bad("overlap", f"must be 0 or 1, got {self.overlap!r}.")
        if self.keep_rounds < 0 or self.keep_rounds == 1:
            raise bad("keep_rounds", f"must be 0 (keep everything) or >= 2, got {self.keep_rounds}.")
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", str(self.run_id)):
            raise bad("run_id", f"{self.run_id!r}: letters, digits, '.', '_' and '-' only (at most 100).")
        if self.outer_optimizer is not None:
            component_spec(self.outer_optimizer, f"{key}.outer_optimizer", cfg)
        if not isinstance(self.compress, str):
            raise bad("compress", f"expected a codec name, got {self.compress!r}.")
        if self.compress not in ("none", "bf16", "int8", "int4"):  # a plugin's: look it up (loads the plugins)
            from composer_plugins.core.errors import UnknownPluginError
            from composer_plugins.core.plugins import get_registry

            try:
                get_registry().get("codecs", self.compress)
            except UnknownPluginError as e:
                raise bad("compress", f"{e} HINT: `composer-plugins list codecs` lists them.") from None
        if self.replicas is not None and (isinstance(self.replicas, bool) or self.replicas < 1):
            raise bad("replicas", f"expected a positive integer, got {self.replicas!r}.")
        from composer_plugins.diloco.transports import get_transport

        get_transport(self.transport, lambda msg: bad("transport", msg)).validate(self, bad)
        if self.jobs is not None:
            from_dict(JobsConfig, self.jobs, cfg, f"{key}.jobs").validate(cfg, f"{key}.jobs")
        return self

    @classmethod
    def from_config(cls, cfg: Config | Mapping[str, Any], key: str = "diloco") -> DiLoCoConfig:
        """Read and validate ``cfg[key]`` (missing section: defaults)."""
        c = cfg if isinstance(cfg, Config) else Config(dict(cfg))
        return from_dict(cls, c.get_path(key) or {}, c, key).validate(c, key)


@dataclasses.dataclass
class ReplicaInfo:
    """Who this replica is, from the environment the launcher sets (defaults: a lone replica 0)."""

    index: int = 0
    num_replicas: int = 1
    replica_id: str = "replica0"
    lighthouse: str | None = None
    restart: int = 0
    seed: int | None = None
    barrier: str | None = None
    barrier_size: int = 0
    stop_file: str | None = None
    sync_log: str | None = None
    rejoin: str | None = None
    store: str | None = None
    run_id: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaInfo:
        e = os.environ if env is None else env
        index = int(e.get(_env.ENV_INDEX, "0"))
        seed = e.get(_env.ENV_SEED)
        return cls(
            index=index,
            num_replicas=int(e.get(_env.ENV_NUM, "1")),
            replica_id=e.get(_env.ENV_REPLICA_ID, f"replica{index}"),
            lighthouse=e.get(_env.ENV_LIGHTHOUSE) or None,
            restart=int(e.get(_env.ENV_RESTART, "0")),
            seed=int(seed) if seed not in (None, "") else None,
            barrier=e.get(_env.ENV_BARRIER) or None,
            barrier_size=int(e.get(_env.ENV_BARRIER_SIZE, "0")),
            stop_file=e.get(_env.ENV_STOP_FILE) or None,
            sync_log=e.get(_env.ENV_SYNC_LOG) or None,
            rejoin=e.get(_env.ENV_REJOIN) or None,
            store=e.get(_env.ENV_STORE) or None,
            run_id=e.get(_env.ENV_RUN_ID) or None,
        )

    @property
    def active(self) -> bool:
        """True when a lighthouse or a store is known, i.e. this process is meant to be a DiLoCo replica."""
        return self.lighthouse is not None or self.store is not None


# -- helpers ------------------------------------------------------------------------------


def param_digest(params: Iterable[torch.Tensor]) -> tuple[str, float]:
    """``(sha256 hex of the raw bytes, float sum)`` of ``params``, in order. Bitwise-identical weights match."""
    import torch

    h = hashlib.sha256()
    total = 0.0
    with torch.no_grad():
        for p in params:
            t = p.detach().to("cpu").contiguous()
            t = t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)  # a parameter subclass: its bytes
            h.update(str(tuple(t.shape)).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())  # device-ok: t was moved to the CPU above
            total += float(t.double().sum())
    return h.hexdigest(), total


def split_fragments(module: nn.Module, num_fragments: int) -> list[nn.Module]:
    """Split ``module``'s trainable parameters into ``num_fragments`` contiguous groups of similar size, each a
    module holding the *same* ``Parameter`` objects (tied weights appear once)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ComposerPluginsError(f"{type(module).__name__} has no trainable parameters for DiLoCo to sync")
    if num_fragments > len(named):
        raise ComposerPluginsError(
            f"num_fragments={num_fragments} but the model has only {len(named)} trainable parameter tensors; "
            f"use at most {len(named)} fragments"
        )
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    acc = 0
    for i, (n, p) in enumerate(named):
        left_items = len(named) - i
        need_groups = num_fragments - len(groups)
        boundary = total * len(groups) / num_fragments
        if groups[-1] and need_groups > 0 and (acc >= boundary or left_items <= need_groups):
            groups.append([])
        groups[-1].append((n, p))
        acc += p.numel()
    assert len(groups) == num_fragments, (len(groups), num_fragments)
    from torch import nn

    class _ParamFragment(nn.Module):
        """A container that registers (shares, never copies) a subset of another module's parameters."""

        def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
            super().__init__()
            for i, (name, p) in enumerate(named):
                self.register_parameter(f"p{i:04d}_{name.replace('.', '_')}", p)

    return [_ParamFragment(g) for g in groups]


def build_outer_optimizer(config: DiLoCoConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    import torch

    if config.outer_optimizer is None:
        return torch.optim.SGD(
            params, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov
        )
    target, kw = component_spec(config.outer_optimizer, "diloco.outer_optimizer")
    path = target.removeprefix("class_path:")
    if "." not in path:
        path = f"torch.optim.{path}"
    try:
        cls = import_object(path)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import outer optimizer {path!r}: {e}", key="diloco.outer_optimizer") from e
    return cls(params, **kw)


def stop_file_says_stop(path: str | None, step: int) -> bool:
    """The launcher's STOP file: absent → go on; empty → stop; a number → stop once ``step`` reaches it."""
    if not path:
        return False
    try:
        text = Path(path).read_text().strip()
    except OSError:  # absent
        return False
    try:
        return not text or step >= int(text)
    except ValueError:
        return True
