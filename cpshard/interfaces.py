"""How cpshard's functions enter transformers: wrappers in its registries, hooks, modules seen through
a proxy.

transformers dispatches attention (``AttentionInterface``) and experts (``ExpertsInterface``) by a name in
the config. cpshard registers a wrapper of the model's own function under ``<prefix><inner>`` and sets
that name: inside a cp call the wrapper moves tokens and calls ``inner``; outside it is ``inner`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


def register_once(registry, name: str, make: Callable[[], Callable]) -> str:
    """``make()`` registered in ``registry`` (one of transformers' ``ALL_..._FUNCTIONS``) as ``name``, unless
    something is registered there already; returns ``name``."""
    if name not in registry:
        registry.register(name, make())
    return name


def register_wrapper(registry, prefix: str, inner: str, wrap: Callable[[str], Callable]) -> str:
    """``wrap(inner)`` registered as ``prefix + inner`` (once); returns that name. A name that already
    carries ``prefix`` is returned as it is; ``eager`` (each modeling file's own function, in no
    registry) is always known."""
    if inner.startswith(prefix):
        return inner
    if inner != "eager" and inner not in registry:
        raise ValueError(
            f"implementation {inner!r} is not in transformers' registry ({type(registry).__name__})"
        )
    return register_once(registry, prefix + inner, lambda: wrap(inner))


class SeenAs:
    """``module`` with some attributes replaced, as a wrapped function should see it (a share of the heads,
    of the experts); every other attribute is the module's own."""

    def __init__(self, module, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


@dataclass(frozen=True)
class Hook:
    """One hook to install: on ``module``, before (``pre``) or after its forward."""

    module: nn.Module
    function: Callable
    pre: bool


class _Marked:
    """A hook function that says it is cpshard's, so that installing again replaces it."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


def _remove_marked(module: nn.Module) -> None:
    for hooks, with_kwargs in (
        (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
        (module._forward_hooks, module._forward_hooks_with_kwargs),
    ):
        for key in [key for key, hook in hooks.items() if isinstance(hook, _Marked)]:
            del hooks[key]
            with_kwargs.pop(key, None)


def _add(hook: Hook) -> None:
    marked = _Marked(hook.function)
    if hook.pre:
        hook.module.register_forward_pre_hook(marked, with_kwargs=True)
    else:
        hook.module.register_forward_hook(marked)


def install_hooks(hooks: list[Hook]) -> None:
    """Install ``hooks``, first removing cpshard's hooks from the modules they go on (so never twice)."""
    for module in {id(hook.module): hook.module for hook in hooks}.values():
        _remove_marked(module)
    for hook in hooks:
        _add(hook)
