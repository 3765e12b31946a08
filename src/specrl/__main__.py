"""`python -m specrl` runs the CLI."""

from specrl.cli.app import main

if __name__ == "__main__":
    main()
