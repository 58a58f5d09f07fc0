import pytest

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.keras.spec import LayerConfig, QuantizationSpec


def test_add_scalar_and_list_forms():
    spec = QuantizationSpec()
    spec.add("Add", is_keras_class=True)
    spec.add(["conv_a", "conv_b"], quantize_input=[False, True], quantization_index=[[0], None])
    spec.add(["add_1", "add_2"], quantization_index=[1])
    assert spec.layers == [
        LayerConfig("Add", True, True, True, None),
        LayerConfig("conv_a", False, False, True, (0,)),
        LayerConfig("conv_b", False, True, True, None),
        LayerConfig("add_1", False, True, True, (1,)),
        LayerConfig("add_2", False, True, True, (1,)),
    ]
    assert spec.classes() == {"Add"} and spec.names() == {"conv_a", "conv_b", "add_1", "add_2"}


def test_last_entry_of_a_name_wins_and_copy_is_independent():
    spec = QuantizationSpec()
    spec.add("x", quantize_weight=True)
    spec.add("x", quantize_weight=False)
    assert spec.by_name()["x"].quantize_weight is False
    copy = spec.copy()
    copy.add("y")
    assert len(spec) == 2 and len(copy) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": ["a", "b"], "quantize_input": [True]}, QdqConfigError, "quantize_input has 1 values for 2 names"),
        ({"name": ["a", "b"], "quantization_index": [[0], [1], [2]]}, QdqConfigError, "3 entries for 2 names"),
        ({"name": "a", "quantization_index": [-1]}, QdqConfigError, "non-negative input positions"),
        ({"name": ""}, QdqTypeError, "non-empty string"),
    ],
)
def test_bad_entries_raise_one_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizationSpec().add(**kwargs)
