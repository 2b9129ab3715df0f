"""cpshard: exact context parallelism for transformers models, with a JAX-style functional API."""

from cpshard.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
from cpshard.forward import CPOutput, make_cp_forward, params_of
from cpshard.grad import value_and_grad
from cpshard.layout import Layout
from cpshard.mesh import make_mesh
from cpshard.parallel import parallelize
from cpshard.processes import LocalRanks, RankError, launch
from cpshard.spec import Spec, SpecError
from cpshard import debug  # last: it sits on top of everything above

__all__ = [
    "CPOutput",
    "Layout",
    "LocalRanks",
    "RankError",
    "Spec",
    "SpecError",
    "launch",
    "load_checkpoint",
    "make_cp_forward",
    "make_mesh",
    "parallelize",
    "params_of",
    "save_checkpoint",
    "save_pretrained",
    "value_and_grad",
]
