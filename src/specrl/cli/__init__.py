"""The ``specrl`` command line: thin Typer commands over the library (one module per command)."""
