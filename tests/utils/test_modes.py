"""eval_mode: eval inside the block, each submodule's own mode after it."""

from torch import nn

from qdq.utils.modes import eval_mode


def test_each_submodule_gets_its_own_mode_back_not_the_roots():
    inner = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()  # a frozen part, kept in eval
    model = nn.Sequential(inner, nn.Dropout())  # the root in training mode
    before = [m.training for m in model.modules()]
    assert before == [True, False, False, False, True]
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before


def test_modes_come_back_when_the_block_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).eval())
    try:
        with eval_mode(model):
            raise RuntimeError
    except RuntimeError:
        pass
    assert [m.training for m in model.modules()] == [True, True, False]
