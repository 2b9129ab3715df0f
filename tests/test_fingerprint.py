"""The code cpshard rewrites is the code it was written for, or the model is refused at setup, on every rank,
naming the class, the installed transformers and what to do: a changed release is never a ``TypeError``
from deep inside a run, nor a wrong number."""

import importlib
import sys

import pytest
import transformers

import cpshard
from cpshard.layouts.family_attention import FORWARDS, WRITTEN_AGAINST
from cpshard.layouts.fingerprint import WRITTEN_FOR, changed, every_table, fingerprint, written_against
from cpshard.tools.tiny import tiny_model


def test_every_rewrite_was_written_for_the_installed_transformers():
    """Fails on a transformers release that changed any code cpshard rewrites or hooks, naming every piece
    it changed in every table (``.ci/drift`` shows it)."""
    assert set(WRITTEN_AGAINST) == set(FORWARDS)
    differing = {name: changed(*pair) for name, pair in every_table().items()}
    assert not any(differing.values()), (transformers.__version__, WRITTEN_FOR, differing)


def test_every_table_is_read_by_its_module():
    """Each table of the file is named by a cpshard module that reads it as its ``WRITTEN_AGAINST``."""
    tables = {name.partition(":")[0] for name in every_table()}
    assert len(tables) >= 10
    for module_name in tables:
        module = importlib.import_module(module_name)
        assert module.WRITTEN_AGAINST == written_against(module_name), module_name


def _module(tmp_path, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_comments_and_docstrings_do_not_change_a_fingerprint_and_code_does(tmp_path):
    sources = {
        "fp_plain": "class A:\n    def f(self, x):\n        return x + 1\n",
        "fp_commented": (
            'class A:\n    """A."""\n\n    def f(self, x):  # one more\n'
            '        """F."""\n        return x + 1\n'
        ),
        "fp_edited": "class A:\n    def f(self, x, y):\n        return x + y\n",
        "fp_more": "class A:\n    def f(self, x):\n        return x + 1\n\n    def g(self):\n        pass\n",
    }
    prints = [fingerprint(_module(tmp_path, name, source).__name__, "A") for name, source in sources.items()]
    assert prints[0] == prints[1] != prints[2]
    assert prints[3] not in prints[:3]  # a class is all its functions
    assert fingerprint("fp_plain", "B") == fingerprint("no_such_module_here", "A") == "absent"


def _changed_signature(self, hidden_states, alibi, attention_mask, cache=None, **kwargs):
    raise AssertionError("the refusal comes before any run")


def refusal_of_a_changed_signature() -> str:
    """make_cp_forward on Bloom with its attention's forward replaced, as a release that changed its
    signature would have it (Falcon's in transformers 5.25): the refusal's message."""
    from transformers.models.bloom.modeling_bloom import BloomAttention

    own = BloomAttention.forward
    BloomAttention.forward = _changed_signature
    try:
        cpshard.make_cp_forward(tiny_model("bloom", attn_implementation="eager"))
    except cpshard.LayoutError as error:
        return str(error)
    finally:
        BloomAttention.forward = own
    return "no error"


def test_a_changed_signature_is_refused_at_setup_on_every_rank(ranks2):
    for message in ranks2.run(refusal_of_a_changed_signature):
        assert "BloomAttention" in message and f"transformers {transformers.__version__}" in message, message
        assert f"install transformers=={WRITTEN_FOR}" in message and "without cp" in message, message


def test_an_unchanged_family_is_not_refused():
    cpshard.make_cp_forward(tiny_model("bloom", attn_implementation="eager"))


@pytest.mark.parametrize("piece", ["BloomModel.forward", "build_alibi_tensor"])
def test_a_change_around_the_attention_is_refused_too(monkeypatch, piece):
    """The layer and the model decide what the attention is given (Falcon's ALiBi moved into its mask)."""
    module = importlib.import_module(WRITTEN_AGAINST["BloomAttention"][0])
    owner, _, name = piece.rpartition(".")
    target = getattr(module, owner) if owner else module
    monkeypatch.setattr(target, name, _changed_signature)
    with pytest.raises(cpshard.LayoutError, match=piece.replace(".", r"\.")):
        cpshard.make_cp_forward(tiny_model("bloom", attn_implementation="eager"))


def _class_with(property_value: int, static_value: int) -> str:
    return (
        f"class A:\n    @property\n    def p(self):\n        return {property_value}\n\n"
        f"    @staticmethod\n    def s():\n        return {static_value}\n"
    )


def test_static_class_and_property_methods_count(tmp_path):
    kinds = {
        "fp_kinds_a": _class_with(1, 1),
        "fp_kinds_b": _class_with(2, 1),
        "fp_kinds_c": _class_with(1, 2),
    }
    prints = {fingerprint(_module(tmp_path, name, source).__name__, "A") for name, source in kinds.items()}
    assert len(prints) == 3
