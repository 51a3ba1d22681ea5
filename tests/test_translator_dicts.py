"""TranslationSpec and TranslatorConfig as dicts: the one codec of checkpoints' identities and export configs."""

import dataclasses
import json

import pytest

from mot_jax.errors import MotJaxError
from mot_jax.training import saved
from mot_jax.training.setup import check_identity
from mot_jax.translate import channels
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.spec import TranslationSpec

SPECS = [
    TranslationSpec.build("replay", channels.terminal(4, 6, 0.5), 4, 6, k_attn=4, rotary=True),
    TranslationSpec.build("direct", None, 4, 6, native_bottom=2, inputs=("source", "hidden"), outputs="hidden"),
]
CONFIGS = [TranslatorConfig(24, 16, 3, dim=32, heads=4), TranslatorConfig(8, 8, 4, kind="projector", linear_skip=True)]
# the fields added after runs were saved (a saved dict without them is one of those runs)
ADDED = {
    TranslationSpec: ("native_bottom", "inputs", "outputs"),
    TranslatorConfig: ("kind", "linear_skip"),
}
UPGRADE = {TranslationSpec: saved.spec_dict, TranslatorConfig: saved.translator_dict}  # at load time


def upgraded(identity: dict) -> dict:
    """A checkpoint identity as `Checkpoints.read_meta` hands it on."""
    return saved.upgrade_meta({"identity": identity})["identity"]


def through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("described", SPECS + CONFIGS, ids=lambda d: type(d).__name__)
def test_to_dict_is_json_and_from_dict_gives_back_the_same(described):
    d = described.to_dict()
    assert through_json(d) == d
    assert type(described).from_dict(through_json(d)) == described


@pytest.mark.parametrize("cls", [TranslationSpec, TranslatorConfig])
def test_a_dict_saved_before_the_added_fields_gets_todays_defaults(cls):
    today = SPECS[0] if cls is TranslationSpec else CONFIGS[0]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    assert all(getattr(today, name) == defaults[name] for name in ADDED[cls])
    old = {k: v for k, v in today.to_dict().items() if k not in ADDED[cls]}
    assert cls.from_dict(UPGRADE[cls](through_json(old))) == today
    assert UPGRADE[cls](old) == today.to_dict()  # what a resume compares


def test_a_run_saved_before_the_added_spec_fields_still_resumes():
    current = {"spec": SPECS[0].to_dict()}
    old = {k: v for k, v in current["spec"].items() if k not in ADDED[TranslationSpec]}
    check_identity(upgraded({"spec": old}), current, "DIR")  # no error
    for changed in ({"native_bottom": 1}, {"inputs": ["source", "embeddings"]}, {"outputs": "hidden"}):
        with pytest.raises(MotJaxError, match="differs in: spec"):
            check_identity(upgraded({"spec": old}), {"spec": current["spec"] | changed}, "DIR")
