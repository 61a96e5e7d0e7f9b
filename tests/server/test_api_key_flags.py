"""The server's API key can be kept out of the process list: --api-key-file, $PAGODA_API_KEY,
and a --help that says --api-key shows in `ps`."""

from __future__ import annotations

import argparse

import pytest

from pagoda.server.cli import add_server_flags, resolve_api_key


def _server_args(*argv: str) -> argparse.Namespace:
    return add_server_flags(argparse.ArgumentParser()).parse_args(list(argv))


def test_api_key_from_file_flag_or_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert resolve_api_key(_server_args("--api-key-file", str(key_file))) == "s3cret"
    assert resolve_api_key(_server_args("--api-key", "k")) == "k"
    assert resolve_api_key(_server_args()) is None
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    assert resolve_api_key(_server_args()) == "from-env"
    assert resolve_api_key(_server_args("--api-key-file", str(key_file))) == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key(_server_args("--api-key", "k", "--api-key-file", str(key_file)))
    with pytest.raises(ValueError, match="--api-key-file: cannot read"):
        resolve_api_key(_server_args("--api-key-file", str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(_server_args("--api-key-file", str(tmp_path / "empty")))


def test_help_warns_that_api_key_shows_in_ps() -> None:
    parser = add_server_flags(argparse.ArgumentParser())
    [action] = [a for a in parser._actions if "--api-key" in a.option_strings]
    assert "process list" in action.help and "--api-key-file" in action.help
