"""``cpshard layout``: the printed layout file is Python that gives back the layout cpshard uses."""

import pytest

from cpshard.cli import main
from cpshard.layouts.registry import resolve_layout
from cpshard.tools.layout_file import layout_for
from cpshard.tools.tiny import tiny_model


@pytest.mark.parametrize("model_type", ["gpt_neox", "gpt_oss", "qwen3", "bloom", "inkling2_text"])
def test_the_printed_file_gives_back_the_layout(model_type):
    namespace = {}
    exec(layout_for(model_type), namespace)  # noqa: S102 -- the file a user would save and import
    assert namespace["LAYOUT"] == resolve_layout(tiny_model(model_type, attn_implementation="auto"))


def test_cli_prints_or_refuses(capsys):
    assert main(["layout", "gpt_neox"]) == 0
    assert "decoder_layers='gpt_neox.layers'," in capsys.readouterr().out
    assert main(["layout", "xlnet"]) == 1  # cpshard refuses it: 1, as cpshard check
    assert "two-stream relative attention" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # bad usage: 2, as cpshard check
        main(["layout", "no_such_type"])
    assert exit_.value.code == 2 and "cannot build a tiny no_such_type" in capsys.readouterr().err


def test_a_rewritten_attention_is_named_in_the_file():
    assert "# cpshard rewrites BloomAttention's forward" in layout_for("bloom")
    assert "rewrites" not in layout_for("gpt_neox")
