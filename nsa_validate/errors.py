"""Exit codes (README: CLI, exit codes, CI gate) and the exceptions that map to them."""
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_ENV_BROKEN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(Exception):
    """Bad usage or input: one line to the user, exit 2."""
