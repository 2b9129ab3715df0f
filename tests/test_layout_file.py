"""``cpshard layout``: the printed layout file is Python that gives back the layout cpshard uses."""

import pytest

from cpshard.cli import main
from cpshard.layouts.registry import resolve_layout
from cpshard.tools.layout_file import layout_for
from cpshard.tools.tiny import tiny_model


@pytest.mark.parametrize(
    "model_type", ["gpt_neox", "gpt_oss", "qwen3", "bloom", "inkling2_text", "qwen3_next", "nemotron_h"]
)
def test_the_printed_file_gives_back_the_layout(model_type):
    namespace = {}
    exec(layout_for(model_type), namespace)  # noqa: S102 -- the file a user would save and import
    assert namespace["LAYOUT"] == resolve_layout(tiny_model(model_type, attn_implementation="auto"))


def test_the_file_reads_as_a_table():
    """Related rows share a line, as the registered files write them; what does not fit takes lines apart
    (a tensor-parallel plan a line per module)."""
    printed = layout_for("qwen3")
    assert "    name='qwen3', model_types=('qwen3',),\n" in printed
    assert (
        "\n    decoder='model', decoder_layers='model.layers', attention='self_attn', "
        "final_norm='model.norm'," in printed
    )
    assert (
        "\n        'mlp.gate_proj': 'colwise', 'mlp.up_proj': 'colwise', 'mlp.down_proj': 'rowwise',\n"
        in printed
    )


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next", "zamba2", "nemotron_h", "jamba"])
def test_the_file_fits_110_columns(model_type):
    """Every line within 110 columns, a recurrent row's fields on lines of their own where it is long."""
    printed = layout_for(model_type)
    assert max(len(line) for line in printed.splitlines()) <= 110, printed


def test_cli_prints_or_refuses(capsys):
    assert main(["layout", "gpt_neox"]) == 0
    assert "decoder_layers='gpt_neox.layers'," in capsys.readouterr().out
    assert main(["layout", "xlnet"]) == 1  # cpshard refuses it: 1, as cpshard check
    assert "two-stream relative attention" in capsys.readouterr().err
    for bad, says in [
        ("no_such_type", "unknown model type 'no_such_type'"),
        ("./no/folder", "no folder"),
        ("t5", "model type 't5' has no causal LM in transformers"),  # not its 200 configs' names
    ]:
        with pytest.raises(SystemExit) as exit_:  # bad usage: 2, as cpshard check, in its words
            main(["layout", bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_folder_s_config_gives_its_layout(tmp_path, capsys):
    """A saved model's folder: its config's fields made tiny (they named model_type twice, and every folder
    was a usage error: "tiny_model() got multiple values for argument 'model_type'")."""
    tiny_model("mistral", sliding_window=5).config.save_pretrained(tmp_path)
    assert main(["layout", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "model_types=('mistral',)," in printed and "decoder_layers='model.layers'," in printed


def test_a_rewritten_attention_is_named_in_the_file():
    assert "# cpshard rewrites BloomAttention's forward" in layout_for("bloom")
    assert "rewrites" not in layout_for("gpt_neox")
