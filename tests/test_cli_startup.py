"""The tool commands answer without importing torch, Lightning or DeepSpeed; the package still registers its names."""

import json
import subprocess
import sys

HEAVY = ("torch", "lightning", "deepspeed", "transformers")


def _heavy_modules_after(code: str) -> list[str]:
    report = f"import json, sys; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", f"{code}\n{report}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_help_strategies_and_presets_import_nothing_heavy():
    code = "from lightning_hpz.cli.main import main\nmain(['--help'])\nmain(['strategies'])\nmain(['presets'])"
    assert _heavy_modules_after(code) == []


def test_tool_help_imports_nothing_heavy():
    code = (
        "from lightning_hpz.cli.main import main\n"
        "for tool in ('bench', 'plan', 'export', 'consolidate'):\n"
        "    try:\n        main([tool, '--help'])\n    except SystemExit as done:\n        assert not done.code"
    )
    assert _heavy_modules_after(code) == []


def test_importing_the_package_imports_nothing_heavy():
    assert _heavy_modules_after("import lightning_hpz") == []


def test_names_are_registered_when_lightning_is_imported_after_the_package():
    # the other order (Lightning first) registers at `import lightning_hpz`, as every in-process test here does
    code = "import lightning_hpz\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
    code += "assert 'hpz' in StrategyRegistry"
    assert "lightning" in _heavy_modules_after(code)
