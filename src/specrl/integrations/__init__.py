"""Optional GPU backends behind the same interfaces as their embedded counterparts.

Each module imports its backend lazily (inside functions), so importing specrl never needs it;
a missing backend raises :func:`specrl.errors.missing_extra` naming the exact pip command.
"""
