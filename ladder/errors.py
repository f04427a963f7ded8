"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class UsageError(Exception):
    """Bad input (a path, a flag, a recipe key): the message says what is wrong and how to fix it."""
