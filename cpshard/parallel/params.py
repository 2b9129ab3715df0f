"""The params pytree that cpshard's functions take: a dict of a model's tensors by name
(``cpshard.params_of(model)``), checked to be one where it is taken, since a model or its
``named_parameters()`` in its place fails deep inside with a message that names neither."""

from __future__ import annotations

from collections.abc import Mapping


def check_params_mapping(params, taker: str) -> None:
    """A ``TypeError`` naming ``taker`` unless ``params`` is a mapping of names to tensors."""
    if not isinstance(params, Mapping) or not all(isinstance(name, str) for name in params):
        raise TypeError(
            f"{taker}: params must be a dict of the model's tensors by name (cpshard.params_of(model)), got "
            f"{type(params).__name__}"
        )
