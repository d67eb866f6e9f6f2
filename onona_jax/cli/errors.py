"""The two anticipated failures a command reports as one `error:` line (`command.run`)."""


class Failure(RuntimeError):
    """An anticipated runtime failure (a failed write, a non-finite loss): exit status 1."""


class UsageError(ValueError):
    """Bad usage: exit status 2."""
