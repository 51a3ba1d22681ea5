"""Every method's outputs on tiny random models (`method_outputs.py`) against those the code gave before the model
layer's per-layer hooks replaced its translator-specific arguments (`fixtures/method_outputs.npz`): the same within a
tolerance derived from float32's epsilon and each output's magnitude (the fixtures travel between CPUs whose
instruction sets round in different places), token ids and masks exactly."""

from pathlib import Path

import numpy as np
import pytest
from method_outputs import compute
from tolerances import assert_float32_close

FIXTURE = Path(__file__).parent / "fixtures" / "method_outputs.npz"
ADD = "tests/method_outputs.py --add tests/fixtures/method_outputs.npz"
ULPS = 256  # float32 epsilons of each output's largest magnitude: whole models' rounding, far below a bug's


@pytest.fixture(scope="module")
def outputs():
    return compute()


@pytest.mark.slow
def test_every_method_gives_the_outputs_it_gave_before(outputs):
    saved = np.load(FIXTURE)
    missing = set(outputs) - set(saved.files)
    assert not missing, f"{sorted(missing)} not in the fixture: add a new kind's with `python {ADD}`"
    assert set(saved.files) <= set(outputs)
    for name in saved.files:
        got, want = outputs[name], saved[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if np.issubdtype(want.dtype, np.floating):
            assert_float32_close(got, want, ulps=ULPS)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
