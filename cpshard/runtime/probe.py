"""Verify before trusting: a layout that is not a registered, tested file is checked once per model, and so
is a registered one on a transformers release it was not tested on (the model's code may have changed under
it: :data:`~cpshard.layouts.fingerprint.WRITTEN_FOR`).

On its first call, cp_forward runs a short probe batch (two rows of three tokens per rank, or the widest
halo a recurrent layer's convolution reads, and one more, the second row padded after its first token; the
model's own weights) under cp and in one process, on every rank, and compares each decoder layer's output at
the real positions the rank holds, then the logits, then every gradient of the next-token loss (a backward
can differ where the forward agrees). In a half type
a row beyond the tolerance gets a second look against one process run on the weights cast to fp32: it
passes where cp lies no farther from that than twice one process in the half type does. A mismatch,
or an error in the probe's cp run, is a :class:`LayoutError` on every rank naming the first layer that
differs: cp would give wrong results for this model. The probe runs in eval mode (dropout off). Cost: a
forward without gradients and a forward and backward, plain and under cp, on ``3 * cp + 1`` tokens (and a
copy of the gradients), once per model, layout and implementation, and three all-reduces of a number
(one after each one-process reference, so that a rank whose reference fails cannot leave the others hung;
one on the verdict, which names the earliest difference on any rank).
"""

from __future__ import annotations

import os
import traceback
import weakref
from contextlib import contextmanager

import torch
import transformers
from torch.distributed.tensor import DTensor

from cpshard.layouts.errors import LayoutError
from cpshard.layouts.fingerprint import WRITTEN_FOR
from cpshard.layouts.registry import REGISTERED, model_type_of
from cpshard.parallel.mesh import cp_size
from cpshard.runtime.difference import OneProcessFailed, earliest_difference, first_difference
from cpshard.streams import forked_streams

#: the (layout repr, implementation) pairs verified per model; a pair is marked before its probe runs
_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: cpshard's own source folder: an error raised there is one of its refusals
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def _without_dropout(model):
    """The model in eval mode, then each module's own mode again: dropout draws another mask in each
    run, so a model in training mode with dropout would never agree with itself."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _refused_by_cpshard(error: BaseException | None) -> bool:
    """Whether ``error`` is one of cpshard's own refusals (a ValueError raised in its code), which says what
    to change better than the probe can."""
    frames = traceback.extract_tb(error.__traceback__) if isinstance(error, ValueError) else []
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def _expectation(layout, model) -> str:
    """Whose expectation a cp run that raised failed: the model's own registered file's (perhaps written for
    another transformers release), a derived layout's, or the layout the caller gave (an edit, another type's
    file)."""
    installed = f"installed transformers {transformers.__version__}"
    if _own_file(layout, model):
        return (
            f"as this layout expects ({installed}; cpshard's tested set is constraints.txt in its "
            "repository): write a layout file for this architecture or run it without cp"
        )
    if layout.name.startswith("derived:"):
        return (
            f"as its derived layout expects ({installed}): write a layout file for this architecture or run "
            "it without cp"
        )
    return (
        f"as the layout given describes it ({installed}): check its rows against the model (`cpshard layout "
        "MODEL` prints the one cpshard would use), or run it without cp"
    )


def _unvouched(subject: str, what: str | None, error: BaseException | None, layout, model) -> str:
    """Why cpshard cannot vouch for ``subject``: ``what`` differed between cp and one process, or the probe
    raised ``error`` (named with the frame that raised it: a model's code that does not run on a cp slice,
    often another transformers release, is not a module that mixes tokens)."""
    if isinstance(error, OneProcessFailed):
        cause = error.__cause__
        frame = traceback.extract_tb(cause.__traceback__)[-1]
        return (
            f"cpshard cannot vouch for {subject}: on a probe batch the model's own forward, in one "
            f"process without cp, raised {type(cause).__name__}: {cause} (in "
            f"{os.path.basename(frame.filename)}:{frame.lineno}, {frame.name}). The model does not run as "
            "it is configured (a field its code reads, a changed signature): fix the model or its config; "
            "this is not cp's doing"
        )
    if error is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return (
            f"cpshard cannot vouch for {subject}: on a probe batch its cp run raised "
            f"{type(error).__name__}: {error} (in {os.path.basename(frame.filename)}:{frame.lineno}, "
            f"{frame.name}). The model's code does not run on a cp slice {_expectation(layout, model)}"
        )
    return (
        f"cpshard cannot vouch for {subject}: on a probe batch, {what}. Some module mixes tokens along the "
        "sequence where cp cannot see it, or a per-position input is not cut; write a layout file for this "
        "architecture or run it without cp"
    )


def _own_file(layout, model) -> bool:
    """Whether ``layout`` is the file registered for the model's own type, or a copy equal to it in every
    row (``cpshard layout``'s printed file): another type's file, as ``layout="llama"`` on a model of another
    type, was tested on the types it names only."""
    return REGISTERED.get(model_type_of(model)) == layout


def _untested(layout, model) -> str:
    """Why ``layout`` is not trusted untested on ``model``: not the type's registered file, or that file on
    another transformers release than its tests'."""
    if _own_file(layout, model):
        return f"its tests passed on transformers {WRITTEN_FOR}, not the installed {transformers.__version__}"
    kinds = "an edit, another type's file, a derived layout"
    return f"it is not the registered file of model type {model_type_of(model)!r} ({kinds})"


def _tested_file(layout, model) -> bool:
    """The model's own registered file on the transformers release its tests passed on: trusted as it is."""
    return _own_file(layout, model) and transformers.__version__ == WRITTEN_FOR


def _probe_key(cp_forward):
    """What a probe verifies: the whole layout (an edited one keeps its name) and the implementation (ring
    may differ from Ulysses)."""
    return repr(cp_forward.layout), cp_forward.options.implementation


def probe_pending(cp_forward, mesh) -> bool:
    """Whether a call of ``cp_forward`` on ``mesh`` would probe its layout (:func:`verify_once`): a layout
    that is not the model's own tested file, at cp > 1, not yet verified on this model."""
    model, layout = cp_forward.model, cp_forward.layout
    if _tested_file(layout, model) or cp_size(mesh) == 1:
        return False
    return _probe_key(cp_forward) not in _VERIFIED.get(model, set())


def verify_once(cp_forward, params: dict, mesh) -> None:
    """Probe a layout that is not the model's own registered file, once per model; a LayoutError on every
    rank if cp differs from one process, and on each rank where the probe's cp run fails."""
    if not probe_pending(cp_forward, mesh):
        return
    model, layout, key = cp_forward.model, cp_forward.layout, _probe_key(cp_forward)
    verified = _VERIFIED.setdefault(model, set())
    if any(isinstance(value, DTensor) for value in params.values()):
        raise LayoutError(
            f"cpshard cannot vouch for layout {layout.name!r} on {type(model).__name__}: "
            f"{_untested(layout, model)}, and such a layout is verified on the plain model's parameters "
            "only; call cp_forward once with cpshard.params_of(model) before "
            "cpshard.parallelize(model, mesh), on a mesh without tp or ep (cpshard.make_mesh(cp=...): one "
            "with them takes the parallel parameters only), then call it with the parallel ones"
        )
    verified.add(key)  # the probe's own cp call must not probe again
    subject = f"layout {layout.name!r} on {type(model).__name__}"
    try:  # the probe compares gradients too, whatever the caller's grad mode (an inference first call)
        with _without_dropout(model), forked_streams(model), torch.inference_mode(False), torch.enable_grad():
            found = first_difference(cp_forward, params, mesh)
    except Exception as error:
        # raised at once, entering no other collective: an error the model's code raises on a cp slice
        # stops every rank at the same point, and one raised on one rank alone (out of memory) leaves the
        # others inside a collective of the cp run, which the verdict's all-reduce would pair with (gloo
        # aborts, or both wait for ever); they end at the group's timeout, as after any error on one rank
        verified.discard(key)
        if _refused_by_cpshard(error):  # a clear refusal (ring and ALiBi, a hybrid degree): as it is
            raise
        raise LayoutError(_unvouched(subject, None, error, layout, model)) from error
    earliest = earliest_difference(found, mesh)
    if earliest is not None:
        verified.discard(key)
        raise LayoutError(_unvouched(subject, found.named(earliest), None, layout, model))
