"""deformconv.config: the environment variables, parsed in one place, and the options object."""

import pytest

from deformconv import config
from deformconv.config import ENVIRONMENT, options


def test_every_environment_variable_is_documented():
    """docs/environment.md lists every variable config reads, with its default."""
    import pathlib

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "environment.md").read_text()
    for name, var in ENVIRONMENT.items():
        assert f"`{name}`" in doc, name
        assert var.effect


def test_environment_parsing(monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert (config.backend(), config.autotune(), config.fast_launch(), config.backward_streams(),
            config.workspace_budget()) == (None, False, True, True, None)
    monkeypatch.setenv("DEFORMCONV_BACKEND", "reference")
    monkeypatch.setenv("DEFORMCONV_AUTOTUNE", "1")
    monkeypatch.setenv("DEFORMCONV_FAST_LAUNCH", "0")
    monkeypatch.setenv("DEFORMCONV_BACKWARD_STREAMS", "0")
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "inf")
    assert (config.backend(), config.autotune(), config.fast_launch(), config.backward_streams(),
            config.workspace_budget()) == ("reference", True, False, False, float("inf"))
    for bad in ("-1", "nan", "lots"):
        monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", bad)
        with pytest.raises(ValueError, match="DEFORMCONV_WORKSPACE_BUDGET.*number >= 0"):
            config.workspace_budget()


def test_options_override_restores_and_clears():
    cache = options.cache("test-cache")
    cache["k"] = 1
    with options.override(run_stores=False, min_chunk_programs=3):
        assert not options.run_stores and options.min_chunk_programs == 3 and cache == {}
        cache["k"] = 2
    assert options.run_stores and options.min_chunk_programs == 512 and cache == {}
    with pytest.raises(TypeError, match="unknown option.*no_such_option"):
        with options.override(no_such_option=1):
            pass
