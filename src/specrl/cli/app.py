"""Root of the ``specrl`` CLI: global flags, command registry, error policy.

Error policy (one place): a :class:`~specrl.errors.SpecrlError` prints ``Error: …`` (plus a hint
line) on stderr and exits 1; usage errors exit 2 (Typer/Click); a traceback appears only with
``--debug`` or ``SPECRL_DEBUG=1``.  Importing this module must not import torch: commands import
what they need inside their functions, so ``specrl --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from specrl import __version__
from specrl.cli import env, export_draft, init_draft, profile, rollout, train, warmstart
from specrl.cli.ui import STATE, err
from specrl.errors import SpecrlError

app = typer.Typer(
    name="specrl",
    help="RL post-training with speculative rollouts and an online co-trained EAGLE-3 draft.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"specrl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    json_out: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks (also SPECRL_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """specrl: speculative rollouts with an online co-trained draft, at long context and scale."""
    STATE.json = json_out
    STATE.debug = STATE.debug or debug


app.command("env")(env.env_command)
app.command("warm-start")(warmstart.warmstart_command)
app.command("init-draft")(init_draft.init_draft_command)
app.command("export-draft")(export_draft.export_draft_command)
app.add_typer(rollout.app, name="rollout")
app.command("train")(train.train_command)
app.command("profile-parallelism")(profile.profile_command)


def main() -> None:
    """Console-script entry point with specrl's error policy."""
    try:
        app(prog_name="specrl")
    except SpecrlError as exc:
        if STATE.debug:
            raise
        err.print(f"[bold red]Error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        if exc.hint:
            err.print(f"[dim]hint:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        sys.exit(130)
