"""Bad user input: the one exception type for it (the CLI prints its message on one line and exits
2), and the argparse parser every command uses, which raises it."""

import argparse


class UsageError(Exception):
    """Bad input (a path, a flag, a recipe key): the message says what is wrong and how to fix it."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type name when it has none): what a UsageError
    quotes from a library's multi-line exception."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad arguments as a UsageError (one line, exit 2) instead of printing
    the usage and exiting itself: every command's parser."""

    def error(self, message: str):
        raise UsageError(message)
