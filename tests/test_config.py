"""The shared loader (`rose.config`): a dataclass schema, then YAML files, `key=value` overrides and
values set in code, in that order; whatever OmegaConf refuses is one line naming the full key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from rose.config import load, named_config, read_named_config


@dataclasses.dataclass
class Inner:
    size: int = 4
    name: str | None = None


    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")


@dataclasses.dataclass
class Outer:
    rate: float = 1.0
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_layers_apply_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("rate: 2.0\ninner:\n  size: 5\n  name: file\n")
    assert load(Outer, [path]) == Outer(2.0, Inner(5, "file"))
    assert load(Outer, [path], ["inner.size=6"], {"inner.name": "flag"}) == Outer(2.0, Inner(6, "flag"))
    # An instance is the starting point (a named scenario); untouched keys keep its values.
    assert load(Outer(rate=3.0), overrides=["inner.size=7"]) == Outer(3.0, Inner(7))


def test_values_are_data_not_yaml() -> None:
    # A key given in code (a flag) is never parsed: "true" and "[1]" stay strings.
    assert load(Outer, values={"inner.name": "true"}).inner.name == "true"
    assert load(Outer, values={"inner.name": "[1]"}).inner.name == "[1]"


@pytest.mark.parametrize("overrides, values, message", [
    (["inner.sizes=3"], None, r"^config: inner\.sizes: Key 'sizes' not in 'Inner'"),
    (["no.such.key=1"], None, r"^config: no\.such\.key: Key 'no' not in 'Outer'"),
    (["inner.size=many"], None, r"^config: inner\.size: Value 'many' of type 'str' could not be converted"),
    ([], {"rate": "fast"}, r"^config: rate: Value 'fast' of type 'str' could not be converted"),
    (["inner.size"], None, r"^override 'inner\.size' is not key=value$"),
    # A key of a section, given one level up: the key it names there.
    (["size=3"], None, r"^config: size: Key 'size' not in 'Outer' \(did you mean inner\.size\?\)$"),
    # A dataclass's own check, its message prefixed with the section's key.
    (["inner.size=-1"], None, r"^config: inner\.size must be >= 0, got -1$"),
    (["=3"], None, r"^override '=3' is not key=value$"),
])
def test_refusals_are_one_line_naming_the_key(overrides: list[str], values: dict | None,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        load(Outer, overrides=overrides, values=values)
    assert "\n" not in str(err.value)


def test_label_and_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^scenario x: rate: "):
        load(Outer, overrides=["rate=slow"], label="scenario x")
    with pytest.raises(ValueError, match=r"config file .*nope\.yaml does not exist"):
        load(Outer, [tmp_path / "nope.yaml"])
    path = tmp_path / "deep.yaml"
    path.write_text("inner:\n  extra:\n    depth: 1\n")
    with pytest.raises(ValueError, match=r"^config: inner\.extra\.depth: Key 'extra' not in 'Inner'"):
        load(Outer, [path])


def test_named_configs() -> None:
    assert named_config("bench-train").name == "bench-train.yaml"
    assert read_named_config("bench-train")["rollout"]["max_tokens"] == 24
    with pytest.raises(ValueError, match="no named config 'nope'"):
        named_config("nope")


SCHEMAS = ("rose.config", "rose.coserve.settings", "rose.coserve.serve_config", "rose.runtime.config",
           "rose.sim.scenarios")


@pytest.mark.parametrize("module", SCHEMAS)
def test_config_schemas_load_no_torch(module: str) -> None:
    """A config is read and its types checked in a fraction of a second: the checks that need
    torch (devices, models, the engine's KV layout) import it when they run."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
