"""Regenerate the committed shell completions in completions/ from the installed CLI.

    python scripts/update_completions.py          # rewrite completions/*
    python scripts/update_completions.py --check  # exit 1 if they are stale

The scripts are Typer's: they call back into ``specrl`` for candidates, so they stay valid as
commands are added; what they encode (program name, completion variable) must match the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = {"bash": "specrl.bash", "zsh": "_specrl", "fish": "specrl.fish"}


def generate(shell: str) -> str:
    env = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "specrl", "--show-completion", shell],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.rstrip() + "\n"


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for shell, name in FILES.items():
        path = ROOT / "completions" / name
        text = generate(shell)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print("stale completions: " + ", ".join(stale) + "; run scripts/update_completions.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
