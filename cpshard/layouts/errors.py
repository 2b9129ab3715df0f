"""The layouts' error, apart, so that every module of the package can raise it (the layout type imports the
rewritten families, which refuse code they were not written for)."""


class LayoutError(ValueError):
    """A model that a layout cannot serve (or a layout that cannot be right), with what to do."""
