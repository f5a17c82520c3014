"""The Ray Train example's command line: bad pacing values are refused before Ray starts
(the example is importable without Ray: Ray is imported where the job runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray_train.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ray_train_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["--step-sleep=-0.1", "--alone-sleep=-1"])
def test_negative_pacing_is_refused_naming_the_flags(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _example().parse_args([flag])
    assert exit_info.value.code == 2
    assert "--step-sleep and --alone-sleep must be >= 0" in capsys.readouterr().err


def test_alone_sleep_is_taken() -> None:
    args = _example().parse_args(["--alone-sleep=0.05"])
    assert (args.alone_sleep, args.step_sleep) == (0.05, 0.0)
