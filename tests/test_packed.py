"""oneDNN-packed linear weights (``moss_npu.packed``): the packed product is ``F.linear`` at every row count,
including the padded ones below ``MIN_ROWS``."""

import pytest
import torch
import torch.nn.functional as F

from moss_npu.packed import MIN_ROWS, pack_linear, packed_matmul, packing_available

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
