"""The Megatron-core backend is an extra: importing specrl never needs it, and a missing one is a
one-line error naming the pip command."""

from __future__ import annotations

import sys

import pytest

from specrl.errors import DependencyError


def test_missing_megatron_names_the_extra(monkeypatch):
    from specrl.integrations import megatron

    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron → ImportError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(DependencyError) as err:
        megatron.require()
    assert err.value.hint == "pip install 'specrl[megatron]'"


def test_the_integration_imports_no_megatron_until_asked():
    import subprocess

    code = (
        "import sys, specrl.integrations.megatron, specrl.integrations.megatron.convert, "
        "specrl.integrations.megatron.runtime; "
        "print(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
