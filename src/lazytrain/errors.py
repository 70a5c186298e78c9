"""The one exception type users see: a bad input or an infeasible request, said in one line."""


class LazyTrainError(Exception):
    """Bad input or an infeasible request. The CLI prints `error: <message>` and exits with status 2.

    Messages state the value, the limit and the knob to change, on one line.
    """
