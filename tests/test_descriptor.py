"""QuantDescriptor: seed defaults, predefined descriptors, lossless round trips, errors."""

import numpy as np
import pytest

from qdq import descriptor as d
from qdq.descriptor import QuantDescriptor, ScaledQuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.tensor_quant import QuantDescriptor as ReexportedDescriptor


def test_seed_defaults():
    desc = QuantDescriptor()
    assert (desc.num_bits, desc.name, desc.fake_quant, desc.axis, desc.amax) == (8, None, True, None, None)
    assert (desc.learn_amax, desc.scale_amax, desc.calib_method) == (False, None, "max")
    assert (desc.unsigned, desc.narrow_range) == (False, False)
    assert ScaledQuantDescriptor is QuantDescriptor is ReexportedDescriptor


def test_amax_becomes_float32_array():
    desc = QuantDescriptor(amax=3.1415926536)
    assert isinstance(desc.amax, np.ndarray) and desc.amax.dtype == np.float32
    assert QuantDescriptor(amax=[1, 2]).amax.tolist() == [1.0, 2.0]


def test_axis_is_a_tuple_of_kept_axes():
    assert QuantDescriptor(axis=0).axis == (0,)
    assert QuantDescriptor(axis=(1, 2)).axis == (1, 2)


def test_predefined():
    assert d.QUANT_DESC_8BIT_PER_TENSOR.axis is None
    assert d.QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR.unsigned
    for desc in (d.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL, d.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW):
        assert desc.axis == (0,)
    # TensorRT needs per-input-channel scales for deconvolution weights: axis 0 of (C_in, C_out/g, k...).
    assert d.QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL.axis == (0,)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 2, "name": "a", "axis": (1, 2), "amax": 3.1415926536},
        {"num_bits": 4, "calib_method": "histogram", "narrow_range": True, "axis": 0},
        {"unsigned": True, "scale_amax": 0.9, "fake_quant": False},
        {"learn_amax": True, "amax": 2.0},
        {"amax": [0.5, 1.5, 2.5], "axis": 0, "name": "w"},
    ],
)
def test_dict_and_yaml_round_trips_are_lossless(kwargs):
    desc = QuantDescriptor(**kwargs)
    assert QuantDescriptor(**desc.dict()) == desc
    assert QuantDescriptor.from_dict(desc.dict(full=True)) == desc
    assert QuantDescriptor.from_yaml(desc.to_yaml()) == desc
    # The seed dropped these two fields; we keep them.
    back = QuantDescriptor.from_yaml(desc.to_yaml())
    assert back.calib_method == desc.calib_method and back.narrow_range == desc.narrow_range


def test_immutable_and_replace():
    desc = QuantDescriptor(num_bits=8)
    with pytest.raises(AttributeError):
        desc.num_bits = 4
    assert desc.replace(num_bits=4).num_bits == 4 and desc.num_bits == 8


def test_str_and_repr():
    text = str(QuantDescriptor(num_bits=4, axis=0, unsigned=True))
    assert "4bit" in text and "axis=(0,)" in text and "unsigned" in text
    assert "full_range" not in str(QuantDescriptor(amax=1.0))  # the seed appended it by mistake


def test_unknown_key_suggests():
    with pytest.raises(QdqTypeError, match=r"Unused keys: \['calib_methd'\].*Did you mean 'calib_method'"):
        QuantDescriptor(calib_methd="max")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"amax": "oops"}, QdqTypeError, "amax must be"),
        ({"amax": -1.0}, QdqConfigError, "non-negative"),
        ({"axis": 0, "learn_amax": True}, QdqConfigError, "learn_amax"),
        ({"num_bits": 1}, QdqConfigError, "not supported"),
        ({"num_bits": (4, 3)}, QdqTypeError, "FP8"),
        ({"axis": "0"}, QdqTypeError, "axis must be"),
        ({"axis": (1, 1)}, QdqConfigError, "repeats"),
        ({"unsigned": True, "narrow_range": True}, QdqConfigError, "signed"),
        ({"scale_amax": 0}, QdqConfigError, "positive"),
        ({"fake_quant": 1}, QdqTypeError, "bool"),
    ],
)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantDescriptor(**kwargs)


def test_copy_and_pickle():
    import copy
    import pickle

    desc = QuantDescriptor(num_bits=4, axis=0, amax=[1.0, 2.0], calib_method="histogram")
    assert copy.deepcopy(desc) == desc and pickle.loads(pickle.dumps(desc)) == desc
    with pytest.raises(ValueError):
        desc.amax[0] = 5.0
