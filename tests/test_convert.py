"""`python -m mot_jax.convert`: loading variants, the --check report, and clear errors on bad checkpoints."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, save_tiny
from safetensors.numpy import load_file, save_file

from mot_jax.convert import convert
from mot_jax.errors import MotJaxError
from mot_jax.models.loading import load_model
from mot_jax.models.registry import flat_params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    save_tiny(CONFIGS["qwen2"]["untied_sliding"](), path)
    return path


def copy_checkpoint(src, dst, edit=None):
    """A copy of a checkpoint directory whose tensors pass through `edit(dict) -> dict`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file(edit(tensors) if edit else tensors, dst / "model.safetensors")
    return dst


def same_params(a, b):
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k][...]), np.asarray(pb[k][...]), err_msg=k)


def test_check_passes_and_reports(checkpoint):
    lines = []
    assert convert(str(checkpoint), check=True, out=lines.append) == 0
    assert "random token ids" in lines[1] and "largest difference" in lines[1] and lines[-1].startswith("OK")


def test_check_fails_beyond_tolerance(checkpoint):
    lines = []
    assert convert(str(checkpoint), check=True, atol=1e-12, out=lines.append) == 1
    assert lines[-1].startswith("FAILED")


def test_sharded_safetensors_and_pytorch_bin_load_the_same_params(checkpoint, tmp_path):
    reference, _ = load_model(str(checkpoint))
    hf = save_tiny(CONFIGS["qwen2"]["untied_sliding"](), tmp_path / "unused")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    same_params(reference, load_model(str(tmp_path / "sharded"))[0])
    torch_dir = tmp_path / "bin"
    torch_dir.mkdir()
    (torch_dir / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, torch_dir / "pytorch_model.bin")
    same_params(reference, load_model(str(torch_dir))[0])


def drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def reshape(name):
    return lambda t: {**t, name: t[name][:-1]}


def extra(name):
    return lambda t: {**t, name: np.zeros(3, np.float32)}


@pytest.mark.parametrize(
    "edit,message",
    [
        (drop("model.layers.1.self_attn.k_proj.weight"), "lacks tensor 'model.layers.1.self_attn.k_proj.weight'"),
        (reshape("model.layers.0.mlp.up_proj.weight"), "Tensor 'model.layers.0.mlp.up_proj.weight' has shape"),
        (extra("model.layers.0.extra.weight"), "has tensor 'model.layers.0.extra.weight'"),
    ],
    ids=["missing", "wrong-shape", "unexpected"],
)
def test_bad_tensors_are_named(checkpoint, tmp_path, edit, message):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(MotJaxError, match=message.replace("(", r"\(")):
        load_model(str(bad))


def test_truncated_file_is_reported(checkpoint, tmp_path):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MotJaxError, match="corrupt"):
        load_model(str(bad))


def test_unsupported_architecture(checkpoint, tmp_path):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(MotJaxError, match="Architecture 'bert' .* not supported"):
        load_model(str(bad))


def test_command_exits_nonzero_with_one_clear_line(checkpoint, tmp_path):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad", drop("model.norm.weight"))
    for model, message in [(bad, "lacks tensor 'model.norm.weight'"), (tmp_path / "nope", "is not a directory")]:
        run = subprocess.run(
            [sys.executable, "-m", "mot_jax.convert", f"--model={model}"], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 2
        assert message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("value", ["four", -1, 0, 2.5, True])
def test_a_bad_shape_field_in_config_json_is_one_line_naming_file_and_field(checkpoint, tmp_path, value):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": value}))
    with pytest.raises(MotJaxError) as error:
        convert(str(bad))
    message = str(error.value)
    assert str(bad / "config.json") in message and "num_hidden_layers" in message and "positive integer" in message


def test_heads_that_do_not_split_over_kv_heads_are_named(checkpoint, tmp_path):
    bad = copy_checkpoint(checkpoint, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    heads = config["num_attention_heads"]
    (bad / "config.json").write_text(json.dumps({**config, "num_key_value_heads": heads + 1}))
    with pytest.raises(MotJaxError, match="num_attention_heads .* not a multiple of num_key_value_heads"):
        load_model(str(bad))
