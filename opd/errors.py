"""The error a run stops with when it cannot start or continue, on the ground floor so that
every floor (the teachers' client side, the spine, the trainers) raises the same one."""


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""
