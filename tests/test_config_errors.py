"""Config files that cannot be read name the file (and the line), and settings that can never take effect warn once."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import stabilitykit as sk
from stabilitykit.config import coerce_config


def test_malformed_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "stability.yaml"
    path.write_text("log_every_n_steps: 5\nclip: [mode: fixed\n")
    with pytest.raises(ValueError) as info:
        sk.StabilityConfig.from_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid YAML at line 3, column 1: ")
    assert "<unicode string>" not in message and "\n" not in message


def test_malformed_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "stability.json"
    path.write_text('{\n  "log_every_n_steps": 5,\n}\n')
    with pytest.raises(ValueError, match=r"stability\.json: invalid JSON at line 3, column 1: "):
        sk.StabilityConfig.from_file(path)


def test_toml_is_read_as_toml(tmp_path: Path) -> None:
    path = tmp_path / "stability.toml"
    path.write_text('log_every_n_steps = 5\n\n[clip]\nmode = "fixed"\nmax_norm = 0.5\n\n[skip]\nmax_consecutive = 3\n')
    cfg = sk.StabilityConfig.from_file(path)
    assert cfg.clip.max_norm == 0.5 and cfg.skip.max_consecutive == 3 and cfg.log_every_n_steps == 5
    assert coerce_config(str(path)) == cfg  # the drivers take the path too


def test_malformed_toml_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "stability.toml"
    path.write_text("log_every_n_steps = 5\n[clip]\nmode = \n")
    with pytest.raises(ValueError, match=r"stability\.toml: invalid TOML: .*\(at line 3, column 8\)"):
        sk.StabilityConfig.from_file(path)


def test_a_wrong_toml_value_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    """tomllib gives no positions: the key's line is found in the text (tables, dotted keys, inline tables)."""
    path = tmp_path / "stability.toml"
    path.write_text(
        '# stabilitykit\nlog_every_n_steps = 10\n\n[clip]\nmode = "fixed"\nmax_norm = "one"\n\n'
        "[skip]\nmax_consecutive = 2.5\n"
    )
    with pytest.raises(sk.config.ConfigFileError) as info:
        sk.StabilityConfig.from_file(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: line 6: clip.max_norm: ") and lines[0].endswith("(got 'one')"), lines
    assert lines[1].startswith(f"{path}: line 9: skip.max_consecutive: "), lines
    cases = {
        'clip.mode = "fixed"\nclip.max_norm = "one"\n': "line 3: clip.max_norm: ",
        'spikes = { enabled = true, warmup_steps = "7" }\n': "line 2: spikes.warmup_steps: ",
        # a multi-line string holding a line that looks like a table header: passed over
        '[recovery]\nstorage = """\n[clip]\n"""\nmax_lookback = "x"\n': "line 6: recovery.max_lookback: ",
    }
    for text, expected in cases.items():
        path.write_text("log_every_n_steps = 10\n" + text)
        with pytest.raises(sk.config.ConfigFileError) as info:
            sk.StabilityConfig.from_file(path)
        assert any(line.startswith(f"{path}: {expected}") for line in str(info.value).splitlines()), str(info.value)


def test_toml_without_a_reader_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Python 3.10 without tomli: a clear message, not a JSON error."""
    path = tmp_path / "stability.toml"
    path.write_text("log_every_n_steps = 5\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # an entry of None makes the import fail
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(
        ImportError, match=r"stability\.toml: reading TOML configs needs Python 3\.11\+ .*pip install tomli"
    ):
        sk.StabilityConfig.from_file(path)


@pytest.mark.parametrize("name", ["stability.cfg", "stability.ini", "stability"])
def test_other_extensions_are_refused_by_name(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text('{"log_every_n_steps": 5}')
    with pytest.raises(ValueError, match=r"cannot read a config from a .* file; use \.yaml, \.yml, \.json or \.toml"):
        sk.StabilityConfig.from_file(path)


def test_binary_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "stability.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"stability\.yaml: not a UTF-8 text file"):
        sk.StabilityConfig.from_file(path)


def _guard_warnings(config: sk.StabilityConfig, times: int = 2) -> list[str]:
    """The stabilitykit warnings of building ``times`` guards with ``config`` (from a clean slate)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sk.config._WARNED.clear()  # once per process: start from a clean slate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            sk.StabilityGuard(model, opt, config)
    return [str(w.message) for w in caught if str(w.message).startswith("stabilitykit: ")]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            sk.StabilityConfig(clip=sk.ClipConfig(max_norm=1.0)),
            "ClipConfig(max_norm=1.0) has no effect with ClipConfig(mode='off') (the default): nothing is clipped",
        ),
        (
            sk.StabilityConfig.from_mapping({"clip": {"mode": "adaptive", "max_norm": 2.0}}),
            "ClipConfig(max_norm=2.0) has no effect with ClipConfig(mode='adaptive')",
        ),
        (
            sk.StabilityConfig(data=sk.DataGuardConfig(num_classes=50257)),
            "DataGuardConfig(num_classes=50257) has no effect with DataGuardConfig(mode='off')",
        ),
        (
            sk.StabilityConfig(grad_norm=sk.GradNormConfig(per_layer=False), spikes=sk.SpikeConfig(per_layer=True)),
            "SpikeConfig(per_layer=True) has no effect with GradNormConfig(per_layer=False)",
        ),
    ],
)
def test_a_setting_that_can_never_take_effect_warns_once(config: sk.StabilityConfig, expected: str) -> None:
    caught = _guard_warnings(config)
    assert len(caught) == 1, caught
    assert expected in caught[0]


@pytest.mark.parametrize(
    "config",
    [
        sk.StabilityConfig(),
        sk.StabilityConfig(clip=sk.ClipConfig(mode="off"), data=sk.DataGuardConfig(mode="off")),
        sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)),
        sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_max_norm=5.0)),
        sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip", num_classes=10)),
        sk.StabilityConfig(grad_norm=sk.GradNormConfig(per_layer=False)),
        sk.StabilityConfig(
            spikes=sk.SpikeConfig(enabled=False, per_layer=True), grad_norm=sk.GradNormConfig(per_layer=False)
        ),
    ],
)
def test_defaults_and_consistent_settings_do_not_warn(config: sk.StabilityConfig) -> None:
    assert _guard_warnings(config) == []


def test_a_config_where_the_optimizer_goes_is_named() -> None:
    import torch

    model = sk.testing.tiny_gpt()
    cfg = sk.StabilityConfig()
    with pytest.raises(
        TypeError, match=r"got StabilityConfig; .*optimizer comes second.*StabilityGuard\(model, optimizer"
    ):
        sk.StabilityGuard(model, cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a torch optimizer .*got dict"):
        sk.StabilityGuard(model, {"log_every_n_steps": 5})  # type: ignore[arg-type]
    assert sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).step_count == 0


def test_a_frozen_model_is_named() -> None:
    """Not silent, and not an error: a fine-tuning schedule may unfreeze the parameters later."""
    import torch

    model = sk.testing.tiny_gpt().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match=r"none of the \d+ parameters AdamW holds requires grad"):
        sk.StabilityGuard(model, opt)


def test_a_wrong_value_in_a_yaml_file_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "stability.yaml"
    path.write_text("log_every_n_steps: 5\nclip:\n  mode: fixed\n  max_norm: one\n")
    with pytest.raises(ValueError) as info:
        sk.StabilityConfig.from_file(path)
    assert str(info.value) == f"{path}: line 4: clip.max_norm: Input should be a valid number (got 'one')"


def test_a_wrong_value_in_a_json_file_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "stability.json"
    path.write_text('{\n  "log_every_n_steps": 5,\n  "skip": {\n    "max_consecutive": 2.5\n  }\n}\n')
    with pytest.raises(ValueError, match=rf"^{path}: line 4: skip\.max_consecutive: Input should be a valid integer"):
        sk.StabilityConfig.from_file(path)


@pytest.mark.parametrize(
    ("text", "field", "kind"),
    [
        ('log_every_n_steps: "10"', "log_every_n_steps", "integer"),
        ("skip:\n  nonfinite: 'yes'", "skip.nonfinite", "boolean"),
        ("skip:\n  max_consecutive: '7'", "skip.max_consecutive", "integer"),
        ("clip:\n  mode: fixed\n  max_norm: '1e0'", "clip.max_norm", "number"),
    ],
)
def test_a_string_where_a_number_or_bool_belongs_is_refused(tmp_path: Path, text: str, field: str, kind: str) -> None:
    """Quoted numbers and YAML 1.1 words are not converted silently (a file and a mapping alike)."""
    path = tmp_path / "stability.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=rf"{field}: Input should be a valid {kind}"):
        sk.StabilityConfig.from_file(path)
    import yaml

    with pytest.raises(ValueError, match=rf"{field.split('.')[-1]}\n  Input should be a valid {kind}"):
        sk.StabilityConfig.from_mapping(yaml.safe_load(text))


@pytest.mark.parametrize(("given", "on"), [(None, False), (False, False), (True, True), ({}, True)])
def test_recovery_given_as_a_switch(given: object, on: bool) -> None:
    """None/False: off; True/{}: on with RecoveryConfig's defaults (in Python and in a mapping)."""
    for cfg in (sk.StabilityConfig(recovery=given), sk.StabilityConfig.from_mapping({"recovery": given})):  # type: ignore[arg-type]
        assert cfg.recovery.enabled is on
        assert cfg.recovery.model_copy(update={"enabled": False}) == sk.RecoveryConfig()


@pytest.mark.parametrize(
    ("text", "recovery", "monitors"),
    [
        ("recovery:\nmonitors:\n", True, True),  # an empty section: its defaults, on
        ("recovery: true\nmonitors: true\n", True, True),
        ("recovery: false\nmonitors: false\n", False, False),
        ("recovery: null\nmonitors: null\n", False, False),
        ("log_every_n_steps: 5\n", False, False),
    ],
)
def test_recovery_and_monitors_switched_in_a_yaml_file(
    tmp_path: Path, text: str, recovery: bool, monitors: bool
) -> None:
    path = tmp_path / "stability.yaml"
    path.write_text(text)
    cfg = sk.StabilityConfig.from_file(path)
    assert cfg.recovery.enabled is recovery
    assert (cfg.monitors is not None) is monitors
    if monitors:
        assert cfg.monitors == sk.MonitorConfig()
