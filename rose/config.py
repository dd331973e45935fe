"""One loader for every command's configuration: a dataclass schema, YAML files, dotted overrides.

`rose train`, `rose serve`, `rose simulate` and `rose bench` each describe their settings as
dataclasses. `load` starts from one (its defaults, or an instance such as a named scenario), then
merges YAML files, `key=value` overrides and values set in code (command-line flags), in that
order, type-checked by OmegaConf. Whatever OmegaConf refuses becomes one `ValueError` line that
names the full dotted key and what was expected; each command's own checks (ranges, names, what
fits where) stay beside its schema.

Named configs ship in rose/data/configs: `named_config("bench-train")` is `rose bench train`'s
workload, which the simulator's `cpu-bench-train` scenario reads too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


def load(schema: type[T] | T, files: Sequence[str | Path] = (), overrides: Sequence[str] = (),
         values: Mapping[str, Any] | None = None, label: str = "config") -> T:
    """`schema` (a dataclass, or an instance of one for its values), then each YAML file, then
    `key=value` overrides, then `values` (dotted key -> value). Types are checked, nothing else;
    errors start with `label`."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r} is not key=value")
    for path in files:
        if not Path(path).is_file():
            raise ValueError(f"config file {path} does not exist")
    layers = [*(OmegaConf.load(path) for path in files), OmegaConf.from_dotlist(list(overrides))]
    if values:
        layers.append(OmegaConf.create(_nested(values)))
    conf = OmegaConf.structured(schema)
    for layer in layers:
        try:
            conf = OmegaConf.merge(conf, layer)
        except OmegaConfBaseException as exc:
            raise _error(exc, OmegaConf.to_container(layer), conf, label) from None
    try:
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as exc:
        raise _error(exc, {}, conf, label) from None
    except ValueError as exc:  # a dataclass's own checks, whose messages start with the field's name
        raise ValueError(f"{label}: {_refusing(conf)}{exc}") from None


def _nested(values: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a.b": 1}` as `{"a": {"b": 1}}`: merged as data, so a string value is never parsed as YAML."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _error(exc: OmegaConfBaseException, source: Any, conf: DictConfig, label: str) -> ValueError:
    """One line naming the full dotted key: OmegaConf names only the first level it does not
    know (`no` for `no.such.key=1`), so an unknown key is followed down `source` to its leaf.
    An unknown key that a section beside it holds (a setting moved into `executor`) is named."""
    key, hint = getattr(exc, "full_key", None) or "", ""
    if isinstance(exc, ConfigKeyError):
        node = source
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        while isinstance(node, dict) and node:
            first = next(iter(node))
            key, node = f"{key}.{first}", node[first]
        parent, _, leaf = key.rpartition(".")
        section = OmegaConf.select(conf, parent) if parent else conf
        if isinstance(section, DictConfig):
            moved = [f"{parent}.{name}".lstrip(".") for name, child in section.items()
                     if isinstance(child, DictConfig) and leaf in child]
            hint = f" (did you mean {' or '.join(f'{m}.{leaf}' for m in moved)}?)" if moved else ""
    message = str(getattr(exc, "msg", exc)).splitlines()[0]
    return ValueError(f"{label}: {key + ': ' if key else ''}{message}{hint}")


def _refusing(conf: DictConfig, prefix: str = "") -> str:
    """`KEY.` of the innermost section whose dataclass refuses its values ("" for the top one)."""
    for name in conf:
        child = conf[name]
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
            try:
                OmegaConf.to_object(child)
            except ValueError:
                return _refusing(child, f"{prefix}{name}.")
    return prefix


def named_config(name: str) -> Path:
    """The YAML file of a named config shipped with rose (rose/data/configs/NAME.yaml)."""
    path = Path(str(resources.files("rose") / "data" / "configs" / f"{name}.yaml"))
    if not path.is_file():
        raise ValueError(f"no named config {name!r} (rose/data/configs)")
    return path


def read_named_config(name: str) -> dict[str, Any]:
    """A named config's YAML as plain nested dicts, for a reader with its own schema."""
    data = OmegaConf.to_container(OmegaConf.load(named_config(name)))
    assert isinstance(data, dict)
    return data


def import_function(path: str, key: str) -> Callable[..., Any]:
    """A function named in a config as `package.module:function` (as slime names its rollout
    functions), imported; a ValueError naming `key` and what is wrong otherwise."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"config: {key} must be 'package.module:function', got {path!r}")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"config: {key} {path!r} cannot be imported: {exc}") from None
    if not callable(function):
        raise ValueError(f"config: {key} {path!r} is not a function")
    return function
