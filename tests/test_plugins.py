"""Targets of other installed packages (``targets.registry.load_plugins``, entry-point group
``quantpress.targets``): a distribution on ``sys.path`` whose entry point names
tests/int8_target.py registers the int8 kind, whose verb the CLI then offers; an entry point
that fails to import or names no target is a one-line error naming it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantpress.errors import InputError
from quantpress.targets import registry

TESTS = Path(__file__).resolve().parent


def _dist(site: Path, name: str, entries: dict[str, str]) -> Path:
    """An installed distribution ``name`` under ``site`` (its .dist-info only) declaring
    ``entries`` (entry-point name → value) in the plugin group; ``site``."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{registry.PLUGIN_GROUP}]\n{lines}")
    return site


def _run(site: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``site`` and tests/ on the path (tests/ holds the
    plugin's module; ``site`` only its distribution's metadata)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("value", ["int8_target", "int8_target:Int8Target"])
def test_an_installed_plugin_registers_its_target_and_verb(tmp_path, value):
    """Only through the entry point: the fresh process never imports int8_target itself."""
    site = _dist(tmp_path / "site", "int8plugin", {"int8": value})
    code = ("import sys\n"
            "from quantpress.targets import registry\n"
            "assert 'int8_target' not in sys.modules\n"
            "print('loaded', registry.load_plugins())\n"
            "print('kinds', [c.kind for c in registry.registered()])\n"
            "from quantpress.cli.quantize_main import main\n"
            "sys.exit(main(['--help']))\n")
    r = _run(site, code)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "loaded ['int8']" in out
    assert "'int8'" in next(line for line in out if line.startswith("kinds "))
    assert "int8 per-channel symmetric weights in safetensors" in r.stdout   # the verb's help
    assert any(line.split()[:1] == ["int8"] for line in out), r.stdout      # listed as a verb


def test_without_the_distribution_there_is_no_verb(tmp_path):
    """The same process without the distribution's metadata: nothing registers int8 (so the
    test above sees the entry point, not something else)."""
    r = _run(tmp_path, "import sys\nfrom quantpress.cli.quantize_main import main\nsys.exit(main(['--help']))\n")
    assert r.returncode == 0, r.stderr
    assert "int8 per-channel" not in r.stdout


@pytest.mark.parametrize("value, message", [
    ("no_such_plugin_module", r"cannot be imported: ModuleNotFoundError: No module named 'no_such_plugin_module'$"),
    ("int8_target:NoSuchTarget", r"cannot be imported: AttributeError: .*NoSuchTarget"),
    ("json:dumps", r"<function dumps .*> is not a target module or a Target subclass"),
    ("json", r"<module 'json' .*> is not a target module or a Target subclass"),
])
def test_a_bad_plugin_is_one_line_naming_the_entry_point(tmp_path, monkeypatch, value, message):
    import re

    site = _dist(tmp_path / "site", "badplugin", {"bad": value})
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(InputError) as e:
        registry.load_plugins()
    text = str(e.value)
    assert "\n" not in text, text
    assert text.startswith(f"plugin entry point 'bad = {value}' (group quantpress.targets): "), text
    assert re.search(message, text), text


def test_a_bad_plugin_makes_the_command_exit_2_with_one_line(tmp_path):
    """The command itself (building its verbs loads the plugins): exit 2 and the one line
    naming the entry point on stderr, no traceback."""
    site = _dist(tmp_path / "site", "badplugin", {"bad": "no_such_plugin_module"})
    r = _run(site, "import sys\nfrom quantpress.cli.convert_main import main\n"
                   "sys.exit(main(['hf-to-gguf', '--help']))\n")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "error: plugin entry point 'bad = no_such_plugin_module' (group quantpress.targets): "
        "cannot be imported: ModuleNotFoundError: No module named 'no_such_plugin_module'"], r.stderr
