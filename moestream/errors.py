"""The one exception type a user's mistake raises: the CLI prints its message on one line, with no traceback."""


class UserError(Exception):
    """Bad input: a missing file, an unsupported architecture, a prompt longer than the context, ...

    The message names the problem and the way out.
    """
