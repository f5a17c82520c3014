"""The native classes exported by torchft.coordination document their arguments."""

from __future__ import annotations

import inspect

import pytest

import torchft.coordination as coordination


@pytest.mark.parametrize("name", coordination.__all__)
def test_native_class_docstring_has_args_for_every_constructor_argument(name: str) -> None:
    """Each class's docstring has an ``Args:`` section naming every constructor argument."""
    cls = getattr(coordination, name)
    doc = cls.__doc__ or ""
    assert "Args:" in doc, f"{name} has no Args: section"
    args_section = doc.split("Args:", 1)[1]
    params = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    assert params, f"{name}: no constructor signature exposed"
    for param in params:
        assert f"{param}:" in args_section, f"{name}: argument {param!r} is not documented"
