"""Config loading: YAML with line numbers, dotted overrides, ``$env`` secrets, typed sections.

Errors name the file, the line and the dotted key, and list the valid keys with a
"did you mean". Components are given by registry shorthand (``"grpo"`` or
``{"name": "grpo", "epsilon_low": 0.2}``) or Lightning-style
``{"class_path": "pkg.mod.Class", "init_args": {...}}``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml

from composer_plugins.core.errors import ComposerPluginsError, ConfigError, UnknownPluginError
from composer_plugins.core.registry import import_object

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3`` as the float it is in YAML 1.2 (and to DVC, whose ruamel reads
    params.yaml that way). PyYAML's YAML 1.1 resolver wants a dot (``1.0e-3``) and would hand a config a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2's exponent floats (``lr: 1e-3`` is 0.001): every config read goes here."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: safe


class Secret(str):
    """A string read from the environment; its ``repr``/``str`` formatting in logs is masked.

    ``str(secret)`` is masked too; use :meth:`reveal` where the real value is needed
    (an HTTP header), so it cannot leak into logs, MLflow params or exceptions by accident.
    """

    env_var: str

    def __new__(cls, value: str, env_var: str = "") -> Secret:
        obj = super().__new__(cls, value)
        obj.env_var = env_var
        return obj

    def reveal(self) -> str:
        """The real value."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Secret(${self.env_var})" if self.env_var else "Secret(****)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)


def _key_and_parents(key: str) -> Iterator[str]:
    """``a.b.c``, then ``a.b``, then ``a``."""
    parts = key.split(".")
    return (".".join(parts[:i]) for i in range(len(parts), 0, -1))


class Config(dict[str, Any]):
    """A loaded config: plain nested dicts plus where each dotted key came from."""

    def __init__(
        self, data: Mapping[str, Any] | None = None, source: str | None = None, lines: Mapping[str, int] | None = None
    ) -> None:
        super().__init__(data or {})
        self.source = source
        self.lines: dict[str, int] = dict(lines or {})
        #: dotted key -> the ``key=value`` override that set it (errors name the override, not the file)
        self.overrides: dict[str, str] = {}

    def override_of(self, key: str) -> str | None:
        """The command-line override that set ``key`` (or a parent of it), if any: the closest key the file or
        an override gives decides (the file gives a key more precisely than an override of its parent)."""
        k = next((k for k in _key_and_parents(key) if k in self.overrides or k in self.lines), None)
        return self.overrides.get(k) if k is not None else None

    def line_of(self, key: str) -> int | None:
        """Line of ``key`` (or of its closest parent) in :attr:`source`."""
        return next((self.lines[k] for k in _key_and_parents(key) if k in self.lines), None)

    def error(self, key: str, message: str, valid: Sequence[str] | None = None) -> ConfigError:
        """A :class:`ConfigError` located at ``key`` (its file line, or the override that set it)."""
        return ConfigError(
            message, key=key, file=self.source, line=self.line_of(key), valid=valid, override=self.override_of(key)
        )

    def get_path(self, key: str, default: Any = None) -> Any:
        """Value at dotted ``key``, or ``default``."""
        node: Any = self
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node


def _line_map(node: yaml.Node, prefix: str, out: dict[str, int], source: str = "<string>") -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = f"{prefix}.{k.value}" if prefix else str(k.value)
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and str(k.value) in seen:
                raise ConfigError(
                    f"duplicate key (first given on line {seen[str(k.value)]}; YAML would silently keep only the "
                    "last one) — keep one of them",
                    key=key,
                    file=source,
                    line=line,
                )
            seen[str(k.value)] = line
            out[key] = line
            _line_map(v, key, out, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            key = f"{prefix}.{i}"
            out[key] = v.start_mark.line + 1
            _line_map(v, key, out, source)


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = (), resolve_secrets: bool = True) -> Config:
    """Read a YAML mapping from ``path``, apply ``key.sub=value`` overrides, resolve ``$env``.

    With ``resolve_secrets=False`` the ``{$env: NAME}`` references stay as they are (for a
    step that never uses the secret and so must not need it set).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config: {e.strerror}", file=str(p)) from e
    return loads_config(text, source=str(p), overrides=overrides, resolve_secrets=resolve_secrets)


def loads_config(
    text: str, source: str = "<string>", overrides: Iterable[str] = (), resolve_secrets: bool = True
) -> Config:
    """Like :func:`load_config` for YAML text."""
    try:
        node = yaml.compose(text)
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping of keys, got {type(data).__name__}", file=source, line=1)
    lines: dict[str, int] = {}
    if node is not None:
        _line_map(node, "", lines, source)
    cfg = Config(data, source, lines)
    apply_overrides(cfg, overrides)
    if resolve_secrets:
        resolve_env(cfg, cfg)
    return cfg


def _yaml_error(e: yaml.YAMLError, source: str) -> ConfigError:
    """A YAML syntax error located where the fix goes: an unclosed ``{``/``[``/quote at the line that opens it
    (the parser notices only on a later line), anything else at the line the parser stopped."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context, opened = getattr(e, "context", None) or "", getattr(e, "context_mark", None)
    if opened is not None and mark is not None and ("flow" in context or "quoted" in context):
        what = " ".join(context.split()[-2:])  # "flow mapping", "flow sequence", "quoted scalar"
        return ConfigError(
            f"invalid YAML: the {what} opened here is not closed ({problem} on line {mark.line + 1}); "
            "close it or write it in block style",
            file=source,
            line=opened.line + 1,
        )
    return ConfigError(f"invalid YAML: {problem}", file=source, line=mark.line + 1 if mark else None)


def apply_overrides(cfg: dict[str, Any], overrides: Iterable[str]) -> None:
    """Set ``a.b.c=value`` pairs in place; values are parsed as YAML (``1`` is an int, ``[a]`` a list)."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like key.sub=value")
        key, _, raw = ov.partition("=")
        key = key.strip().lstrip("-")
        try:
            value = yaml_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        node: dict[str, Any] = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"cannot set {key!r}: {part!r} is a {type(nxt).__name__}, not a mapping", key=key)
            node = nxt
        node[parts[-1]] = value
        if isinstance(cfg, Config):
            cfg.overrides[key] = ov.strip()


def resolve_env(node: Any, cfg: Config, key: str = "") -> Any:
    """Replace ``{"$env": "NAME"}`` values in place with :class:`Secret` values from the environment."""
    if isinstance(node, dict):
        if set(node) == {"$env"}:
            var = str(node["$env"])
            if var not in os.environ:
                raise cfg.error(key, f"environment variable {var} is not set. HINT: export {var}=...")
            return Secret(os.environ[var], var)
        for k in list(node):
            node[k] = resolve_env(node[k], cfg, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            node[i] = resolve_env(v, cfg, f"{key}.{i}")
    return node


def redact_url(url: str) -> str:
    """``scheme://host/path`` of a URL: no user info, query string (``?sig=``) or fragment."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.split("?", 1)[0]
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rsplit('@', 1)[-1]}{slash}{path}"


def redact(value: Any) -> Any:
    """A copy of ``value`` with every :class:`Secret` (and ``*key*``/``*token*`` field) masked, and URLs cut to
    ``scheme://host/path`` (a signed URL's query string or a URL's user info never reaches a log)."""
    if isinstance(value, Secret):
        return repr(value)
    if isinstance(value, str) and "://" in value and ("?" in value or "@" in value.split("://", 1)[1].split("/")[0]):
        return redact_url(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            sensitive = any(s in str(k).lower() for s in ("api_key", "apikey", "token", "secret", "password"))
            out[k] = "****" if sensitive and isinstance(v, str) and not str(k).endswith("_env") else redact(v)
        return out
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    return value


# -- typed sections -----------------------------------------------------------------


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any or tp is object:
        return True
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(tp))
    if origin is typing.Literal:
        return value in get_args(tp)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, Sequence, tuple):
        return isinstance(value, list | tuple)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    if get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, cfg: Config | None = None, key: str = "") -> T:
    """Build dataclass ``cls`` from ``data``: unknown keys and wrong types raise a located :class:`ConfigError`."""
    cfg = cfg if cfg is not None else Config()
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise cfg.error(key or "<root>", f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        sub = f"{key}.{k}" if key else str(k)
        if k not in fields:
            raise cfg.error(sub, "unknown key.", valid=list(fields))
        tp = hints[k]
        nested = _dataclass_in(tp)
        if nested is not None and isinstance(v, Mapping):
            kwargs[k] = from_dict(nested, v, cfg, sub)
        elif not _type_ok(v, tp):
            raise cfg.error(sub, f"expected {_describe(tp)}, got {v!r} ({type(v).__name__}).")
        else:
            kwargs[k] = v
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise cfg.error(f"{key}.{missing[0]}" if key else missing[0], "required key is missing.", valid=list(fields))
    return cls(**kwargs)


def _dataclass_in(tp: Any) -> type | None:
    options = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    return next((a for a in options if dataclasses.is_dataclass(a) and isinstance(a, type)), None)


def to_dict(obj: Any) -> Any:
    """A dataclass config back to plain data (for ``--print-config`` and MLflow params)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


# -- components ---------------------------------------------------------------------


def component_spec(value: Any, key: str = "", cfg: Config | None = None) -> tuple[str, dict[str, Any]]:
    """Normalise ``"name"``, ``{"name": n, **kw}`` or ``{"class_path": p, "init_args": kw}`` to ``(target, kw)``.

    For ``class_path`` the target is returned as ``"class_path:<dotted path>"``.
    """
    cfg = cfg if cfg is not None else Config()
    if isinstance(value, str):
        return value, {}
    if isinstance(value, Mapping):
        if "class_path" in value:
            extra = set(value) - {"class_path", "init_args"}
            if extra:
                raise cfg.error(
                    f"{key}.{sorted(extra)[0]}", "unknown key next to class_path.", valid=["class_path", "init_args"]
                )
            return "class_path:" + str(value["class_path"]), dict(value.get("init_args") or {})
        if "name" in value:
            return str(value["name"]), {k: v for k, v in value.items() if k != "name"}
    raise cfg.error(
        key, f"expected a name, {{name: ..., <args>}} or {{class_path: ..., init_args: ...}}; got {value!r}"
    )


def build_component(
    kind: str, value: Any, key: str = "", cfg: Config | None = None, *, spec_keys: Sequence[str] = (), **extra: Any
) -> Any:
    """Build a component of ``kind`` from config ``value`` (see :func:`component_spec`); ``extra``: arguments
    the caller adds; ``spec_keys``: keys the caller's spec reads itself (listed as valid beside the arguments)."""
    from composer_plugins.core.plugins import get_registry

    cfg = cfg if cfg is not None else Config()
    target, kw = component_spec(value, key, cfg)
    kw.update(extra)
    if target.startswith("class_path:"):
        path = target.split(":", 1)[1]
        try:
            cls = import_object(path)
        except (ImportError, AttributeError, ValueError) as e:
            raise cfg.error(f"{key}.class_path" if key else "class_path", f"cannot import {path!r}: {e}") from e
        return cls(**kw)
    name_key = f"{key}.name" if key and isinstance(value, Mapping) and "name" in value else key or kind
    try:
        entry = get_registry().get(kind, target)
    except UnknownPluginError as e:
        raise cfg.error(name_key, str(e)) from e
    accepted = _accepted_kwargs(entry.factory)
    if accepted is not None:
        for k in kw:
            if k not in accepted and k not in entry.init_params:
                fix = "remove it or use one of its arguments"
                switched = cfg.override_of(f"{key}.name") if key else None
                if switched is not None and cfg.override_of(f"{key}.{k}") is None:
                    # `-S key.name=other` keeps the old component's arguments; -S cannot remove them, a whole spec can
                    whole = f"-S '{key}={{name: {target}}}'"
                    fix = (
                        f"it is an argument of the component that the override {switched!r} replaced, and -S "
                        f"cannot remove it: set the whole spec instead, e.g. {whole}"
                    )
                what = kind[:-2] if kind.endswith("sses") else kind.removesuffix("s")
                raise cfg.error(
                    f"{key}.{k}" if key else k,
                    f"unknown argument of {what} {target!r} — {fix}.",
                    valid=[*spec_keys, *sorted(accepted - set(spec_keys))],
                )
    return build_located(entry, kw, key or kind, cfg)


def build_located(entry: Any, kw: Mapping[str, Any], key: str, cfg: Config | None = None) -> Any:
    """``entry.build(**kw)``; a value the component refuses (``ValueError``/``TypeError``) becomes a
    :class:`ConfigError` at ``<key>.<argument>`` (the argument its message names, else ``key``) in ``cfg``'s
    file and line."""
    cfg = cfg if cfg is not None else Config()
    try:
        return entry.build(**kw)
    except ConfigError as e:
        if e.file is not None or e.override is not None:
            raise
        raise _locate_nested(e, kw, key, cfg) from e
    except ComposerPluginsError:
        raise
    except (ValueError, TypeError) as e:
        # a value the component refused: locate it at the argument its message names, else at the spec
        bad = next((k for k, v in kw.items() if repr(v) in str(e) or f"'{v}'" in str(e)), None)
        bad = bad or next((k for k in kw if k in str(e)), None)
        where = f"{key}.{bad}" if key and bad else (bad or key)
        raise cfg.error(where, f"{e} — fix {where}.") from e


def check_component_name(kind: str, value: Any, key: str, cfg: Config | None = None) -> None:
    """Refuse at load, located at ``key`` (or ``key.name``), a component ``value`` naming no registered ``kind``.

    Nothing is built: a typo in a component that is built late (or only by some commands) is
    reported when the config is read, as ``file:line: key: Unknown <kind> ... Did you mean ...``.
    """
    from composer_plugins.core.plugins import get_registry

    cfg = cfg if cfg is not None else Config()
    if value is None or not isinstance(value, str | Mapping):
        return
    target, _ = component_spec(value, key, cfg)
    if target.startswith("class_path:"):
        return
    try:
        get_registry().get(kind, target)
    except UnknownPluginError as e:
        raise cfg.error(f"{key}.name" if isinstance(value, Mapping) else key, str(e)) from e


def _find_name(node: Any, name: str, path: str = "") -> str | None:
    """Dotted path inside ``node`` of a component spec naming ``name`` (``"x"`` or ``{name: x}``)."""
    if isinstance(node, str):
        return path if node == name else None
    if isinstance(node, Mapping):
        if node.get("name") == name:
            return f"{path}.name" if path else "name"
        items: Iterable[tuple[Any, Any]] = node.items()
    elif isinstance(node, list | tuple):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        found = _find_name(v, name, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def _locate_nested(e: ConfigError, kw: Mapping[str, Any], key: str, cfg: Config) -> ConfigError:
    """An unlocated error of a component built inside ``key``'s component (a ``chain``'s providers), located."""
    cause = e.__cause__
    if isinstance(cause, UnknownPluginError):
        where = _find_name(dict(kw), cause.name)
        return cfg.error(f"{key}.{where}" if where else key, str(cause))
    if e.key and e.key.split(".")[0] in kw:
        return cfg.error(f"{key}.{e.key}", e.problem, valid=e.valid)
    return cfg.error(key, str(e))


def _accepted_kwargs(factory: Any) -> set[str] | None:
    """Keyword arguments ``factory`` accepts, or ``None`` when that cannot be known.

    A class whose ``__init__`` passes ``**kwargs`` on is followed up its bases until an ``__init__``
    that names all it takes (an env subclass forwarding ``max_turns`` to ``Env``).
    """
    import inspect

    inits = (
        [c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__]
        if isinstance(factory, type)
        else [factory]
    )
    names: set[str] = set()
    for fn in inits:
        if fn is object.__init__:
            return None
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        names |= {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            return names - {"self"}
    return None
