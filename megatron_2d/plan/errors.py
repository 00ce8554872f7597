"""The planner's one error type (its own module, so that every planner module can raise it)."""


class PlanError(ValueError):
    """Bad planner input: the message names the offending value and what would be valid."""
