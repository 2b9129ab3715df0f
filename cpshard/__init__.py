"""cpshard: exact context parallelism for transformers models, with a JAX-style functional API.

This facade holds the public names (API.md); ``cpshard.debug`` is public too. Every other module is
private: its names may move between releases.
"""

from cpshard import debug
from cpshard.comm.arrival import CollectiveError
from cpshard.generation.decode import make_cp_decode
from cpshard.generation.generate import generate
from cpshard.generation.prefill import make_cp_prefill
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.layout import Layout, Recurrent
from cpshard.optim import AdamState, adamw_init, adamw_update
from cpshard.parallel.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_pretrained
from cpshard.parallel.fsdp import parallelize
from cpshard.parallel.mesh import make_mesh
from cpshard.parallel.processes import LocalRanks, RankError, launch
from cpshard.runtime.batch import BatchError
from cpshard.runtime.count import count_label_tokens
from cpshard.runtime.forward import CPOutput, make_cp_forward, params_of
from cpshard.runtime.grad import value_and_grad
from cpshard.runtime.tokens import shard_like_logits
from cpshard.spec.notation import Spec, SpecError
from cpshard.tools.tiny import tiny_batch, tiny_config, tiny_model, tiny_tokenizer

__all__ = [
    "AdamState",
    "adamw_init",
    "adamw_update",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
    "debug",
    "generate",
    "BatchError",
    "CPOutput",
    "CheckpointError",
    "CollectiveError",
    "Layout",
    "LayoutError",
    "LocalRanks",
    "RankError",
    "Recurrent",
    "Spec",
    "SpecError",
    "count_label_tokens",
    "launch",
    "load_checkpoint",
    "make_cp_decode",
    "make_cp_forward",
    "make_cp_prefill",
    "make_mesh",
    "parallelize",
    "params_of",
    "save_checkpoint",
    "save_pretrained",
    "shard_like_logits",
    "value_and_grad",
]
