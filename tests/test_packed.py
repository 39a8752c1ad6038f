"""oneDNN-packed linear weights (``moss_npu.packed``): the packed product is ``F.linear`` at every row count,
including the padded ones below ``MIN_ROWS``; ``PackedLinear`` keeps an ``nn.Linear``'s parameters and follows edits."""

import pytest
import torch
import torch.nn.functional as F

from moss_npu.packed import MIN_ROWS, PackedLinear, pack_linear, pack_linears, packed_matmul, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")


@pytest.mark.parametrize("rows", [1, 2, MIN_ROWS, 17])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_product_is_linear(rows, with_bias):
    layer = torch.nn.Linear(96, 160, bias=with_bias)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        out = packed_matmul(x, pack_linear(layer.weight), layer.bias)
        expected = F.linear(x, layer.weight, layer.bias)
    assert out.shape == (rows, 160)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_the_parameters_and_follows_edits():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8, bias=False))
    keys, x = list(model.state_dict()), torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = model(x)
        assert pack_linears(model) == 2
        assert isinstance(model[0], PackedLinear) and list(model.state_dict()) == keys
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        model[2].weight.mul_(2)  # an in-place edit: the next call repacks
        torch.testing.assert_close(model(x), expected * 2, rtol=1e-5, atol=1e-5)
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
        assert torch.equal(model(x), torch.zeros(2, 5, 8))


def test_packed_linear_leaves_other_dtypes_to_torch():
    layer = PackedLinear(torch.nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_failing_kernel_means_no_packing(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr("moss_npu.packed.pack_linear", broken)
    assert not packing_available()
