"""Integrations of codetta's fused operators into model libraries."""


class UnsupportedModelError(ValueError):
    """The model (or an option of it) is not one codetta can patch; nothing was changed."""
