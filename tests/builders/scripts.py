"""Entry points run in-process as a user types them, and what a refusal must look like."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_root_logging():
    """The scripts' logging.basicConfig binds the root logger to this test's captured stderr:
    undo it, so that later tests do not log into a closed stream (import it into a test module
    that runs scripts in-process)."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def script_main(script: str, args, monkeypatch):
    """``scripts/<script>`` (or an entry point) in-process, as a user types it (Hydra reads sys.argv)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.delenv("MSD_DEBUG", raising=False)
    return module.main()


def refused_in_process(capsys, call, *phrases) -> str:
    """``call()`` exits 1 with one ``error:`` paragraph, no traceback, naming ``phrases``."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert "Traceback" not in err and "error: " in err, err
    for p in phrases:
        assert p in err, err
    return err
