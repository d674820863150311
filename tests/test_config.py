"""Config validation: clear errors naming the field, YAML/JSON loading."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

import stabilitykit as sk


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValidationError, match="max_nrom"):
        sk.ClipConfig(mode="fixed", max_nrom=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="log_every"):
        sk.StabilityConfig(log_every=3)  # type: ignore[call-arg]


def test_bad_values_are_named() -> None:
    with pytest.raises(ValidationError, match="max_norm"):
        sk.ClipConfig(mode="fixed", max_norm=-1.0)
    with pytest.raises(ValidationError, match="norm_type"):
        sk.GradNormConfig(norm_type=0)
    with pytest.raises(ValidationError, match="mode"):
        sk.ClipConfig(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="grouping"):
        sk.GradNormConfig(grouping=["blocks.(\\d"])
    with pytest.raises(ValidationError, match=r"clip\.max_norm"):
        sk.StabilityConfig.from_mapping({"clip": {"max_norm": 0}})


def test_inf_norm_and_files(tmp_path) -> None:
    assert sk.GradNormConfig(norm_type="inf").norm_type == math.inf  # type: ignore[arg-type]
    yaml_file = tmp_path / "stability.yaml"
    yaml_file.write_text("log_every_n_steps: 5\nclip:\n  mode: fixed\n  max_norm: 0.5\nskip:\n  max_consecutive: 3\n")
    cfg = sk.StabilityConfig.from_file(yaml_file)
    assert cfg.clip.max_norm == 0.5 and cfg.skip.max_consecutive == 3 and cfg.log_every_n_steps == 5
    json_file = tmp_path / "stability.json"
    json_file.write_text(json.dumps(cfg.model_dump()))
    assert sk.StabilityConfig.from_file(json_file) == cfg
    bad = tmp_path / "bad.yaml"
    bad.write_text("clip:\n  mode: fixed\n  maxnorm: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: line 3: clip\.maxnorm: .*no field 'maxnorm'"):
        sk.StabilityConfig.from_file(bad)


def test_guard_accepts_a_mapping() -> None:
    model = sk.testing.tiny_gpt()
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, opt, {"clip": {"mode": "fixed", "max_norm": 2.0}})
    assert guard.config.clip.max_norm == 2.0


def test_errors_a_newcomer_makes_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no field 'max_nrom'; did you mean 'max_norm'"):
        sk.StabilityConfig.from_mapping({"clip": {"mode": "fixed", "max_nrom": 2.0}})
    with pytest.raises(ValueError, match=r"max_norm=0 .*ClipConfig\(mode='off'\)"):
        sk.StabilityConfig(clip=sk.ClipConfig(max_norm=0))
    missing = tmp_path / "missing.yaml"
    with pytest.raises(FileNotFoundError) as info:
        sk.StabilityConfig.from_file(missing)
    assert str(info.value) == f"stabilitykit config file not found: {missing}"


def test_cli_version_and_report_output_default(capsys: pytest.CaptureFixture[str]) -> None:
    from stabilitykit.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"stabilitykit {sk.__version__}"
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "(default: report.png)" in capsys.readouterr().out
