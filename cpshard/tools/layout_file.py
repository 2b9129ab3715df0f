"""``cpshard layout``: the layout cpshard derives for a model type or a config folder, as a layout file.

The printed file is Python a user can read, save and edit, then pass as ``make_cp_forward(model,
layout=LAYOUT)``. The model is built tiny from the config (layout rows name config fields and module
paths, never sizes), so nothing is downloaded and no weights are needed.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from transformers import AutoConfig

from cpshard.layouts.family_attention import rewritten
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import REGISTERED, resolve_layout
from cpshard.layouts.structure import attention_layers
from cpshard.spec.notation import Spec
from cpshard.tools.model_source import ModelSource, resolve_source
from cpshard.tools.tiny import tiny_model
from cpshard.tools.tiny_sizes import SMALL
from cpshard.tools.usage import UsageError


def _value(value) -> str:
    if isinstance(value, Spec):
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(_value(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    if hasattr(value, "items"):
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in value.items()) + "}"
    return repr(value)


#: rows that share a line, as the registered files write their tables (what does not fit takes lines apart)
_SHARED_LINES = (
    ("name", "model_types"),
    ("decoder", "decoder_layers", "attention", "final_norm"),
    ("heads", "kv_heads", "mlp_width"),
    ("qkv", "attn_output"),
    ("logits", "head_transforms"),
    ("tensor_parallel_inputs", "experts", "per_head_params", "mlp"),
    ("sparse_attention", "labels_shifted", "whole_inputs", "stream_logits"),
    ("restores_length", "looped", "cut_at_entry"),
    ("recurrent", "pointwise"),
)
_WIDTH = 110


def _row(name: str, value) -> list[str]:
    """One row's lines: on one line where it fits; else a tuple's items a line each, and a dict's entries a
    line per module (the text before the first dot: a tensor-parallel plan by attention and MLP)."""
    line = f"    {name}={_value(value)},"
    if len(line) <= _WIDTH or not value or not (isinstance(value, tuple) or hasattr(value, "items")):
        return [line]
    if isinstance(value, tuple):
        return [f"    {name}=(", *(line for item in value for line in _item(item)), "    ),"]
    by_module = {}
    for key, entry in value.items():
        by_module.setdefault(key.split(".")[0], []).append(f"{key!r}: {entry!r},")
    return [
        f"    {name}={{",
        *(line for entries in by_module.values() for line in _packed(entries)),
        "    },",
    ]


def _item(item) -> list[str]:
    """One item of a tuple row: on one line where it fits; else a row object (a :class:`Recurrent`) with its
    fields on as few lines as fit."""
    line = f"        {_value(item)},"
    if len(line) <= _WIDTH or not is_dataclass(item):
        return [line]
    entries = [f"{f.name}={_value(getattr(item, f.name))}," for f in fields(item)]
    return [f"        {type(item).__name__}(", *_packed(entries, " " * 12), "        ),"]


def _packed(entries: list[str], indent: str = "        ") -> list[str]:
    """``entries`` on as few lines as fit the width, in order."""
    lines = [indent + entries[0]]
    for entry in entries[1:]:
        if len(lines[-1]) + 1 + len(entry) <= _WIDTH:
            lines[-1] += " " + entry
        else:
            lines.append(indent + entry)
    return lines


def _rows(layout: Layout) -> list[str]:
    """Every row of ``layout`` in its fields' order, the rows of :data:`_SHARED_LINES` on one line where
    they fit."""
    lines, done = [], set()
    for field in fields(layout):
        if field.name in done:
            continue
        names = next((group for group in _SHARED_LINES if group[0] == field.name), (field.name,))
        shared = "    " + " ".join(f"{name}={_value(getattr(layout, name))}," for name in names)
        if len(names) > 1 and len(shared) <= _WIDTH:
            lines.append(shared)
        else:
            lines += [line for name in names for line in _row(name, getattr(layout, name))]
        done.update(names)
    return lines


def layout_source(layout: Layout, origin: str, rewritten: tuple[str, ...] = ()) -> str:
    """``layout`` as a layout file, a table as the registered files write one; a comment naming the
    ``rewritten`` attention classes."""
    rows = "\n".join(_rows(layout))
    note = "".join(
        f"# cpshard rewrites {name}'s forward to call transformers' attention registry\n"
        "# (cpshard/layouts/family_attention.py): cp's attention serves it\n"
        for name in rewritten
    )
    return (
        f'"""The cp layout cpshard uses for {origin}\n(edit it, then make_cp_forward(model, '
        'layout=LAYOUT))."""\n\nfrom cpshard import Layout, Recurrent, Spec\n\n'
        + note
        + "LAYOUT = Layout(\n"
        + rows
        + "\n)\n"
    )


def _model_for(source: ModelSource):
    """A tiny model of a model type, or of the config in a local folder (its fields, the sizes shrunk)."""
    if source.folder is None:
        return tiny_model(source.model_type, attn_implementation="auto")
    config = AutoConfig.from_pretrained(source.folder)
    sizes = {key: value for key, value in SMALL.items() if hasattr(config, key)}
    fields = {key: value for key, value in config.to_dict().items() if key != "model_type"}
    return tiny_model(config.model_type, attn_implementation="auto", **{**fields, **sizes})


def layout_for(name: str) -> str:
    """The layout file for ``name`` (a model type or a config folder): registered or derived; a
    :class:`UsageError` naming the problem when no model can be built from it (no such folder or type
    among them), a ``LayoutError`` when cpshard cannot serve the model."""
    source = resolve_source(name)
    try:
        model = _model_for(source)
    except Exception as error:  # noqa: BLE001 -- transformers' validators raise many types
        raise UsageError(f"cannot build a tiny {name}: {type(error).__name__}: {error}") from None
    layout = resolve_layout(model)
    kind = "its registered file" if layout in REGISTERED.values() else "derived from the model"
    layers = model.get_submodule(layout.decoder_layers)
    with_attention = attention_layers(layers, layout)
    inner = [module for layer in with_attention for module in layer.get_submodule(layout.attention).modules()]
    names = tuple(dict.fromkeys(type(module).__name__ for module in inner if rewritten(module)))
    return layout_source(layout, f"{model.config.model_type}: {kind}", names)
