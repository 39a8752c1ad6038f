"""oneDNN-packed linear weights (``moss_npu.cpu.packed``): the packed product is ``F.linear`` at every row count,
including the padded ones below ``MIN_ROWS``; ``PackedLinear`` keeps an ``nn.Linear``'s parameters and follows edits."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from moss_npu.cpu.packed import MIN_ROWS, PackedLinear, pack_linear, pack_linears, packed_matmul, packing_available
from tests.optional import needs

pytestmark = needs(packing_available(), "this torch has no oneDNN weight packing")


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

    monkeypatch.setattr("moss_npu.cpu.packed.pack_linear", broken)
    assert not packing_available()


def test_weights_made_in_inference_mode_are_multiplied_plainly():
    """Parameters created inside ``torch.inference_mode`` (a model loaded there) track no version counter, so an
    in-place edit could not be seen: those layers take ``F.linear`` (they raised before)."""
    with torch.inference_mode():
        layer = PackedLinear(torch.nn.Linear(16, 8))
        x = torch.randn(5, 16)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packed_linear_copies_and_pickles_after_a_call():
    """A used layer deep-copies and pickles (the packed copy is an opaque oneDNN tensor: it is made again)."""
    layer, x = PackedLinear(torch.nn.Linear(16, 8)), torch.randn(5, 16)
    with torch.no_grad():
        expected = layer(x)
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            torch.testing.assert_close(twin(x), expected, rtol=1e-5, atol=1e-5)


def test_packed_linear_follows_a_replaced_weight_tensor():
    """``weight.data = ...`` (and a round trip through another dtype, which does that) swaps the weight's storage
    without moving its version counter: the next call repacks from the new values."""
    layer, x = PackedLinear(torch.nn.Linear(16, 8)), torch.randn(5, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.data = torch.zeros(8, 16)
        assert torch.equal(layer(x), layer.bias.expand(5, 8))
        layer.weight.data = torch.randn(8, 16)
        layer(x)
        layer.half().float()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_trains_like_linear():
    """With gradients wanted the product is ``F.linear`` (the packed kernel has no backward: grads were lost)."""
    plain = torch.nn.Linear(16, 8)
    layer, x = PackedLinear(copy.deepcopy(plain)), torch.randn(5, 16)
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_a_weight_turned_to_another_dtype_frees_its_packing():
    layer, x = PackedLinear(torch.nn.Linear(16, 8)), torch.randn(5, 16)
    with torch.no_grad():
        layer(x)
        layer.to(torch.bfloat16)
        layer(x.to(torch.bfloat16))
    assert layer._cache is None
