"""A row's gates have the same bits whatever rows run beside it (layers/gdn.py `rowwise`): torch's
elementwise ops round a vector body and a scalar tail differently, so without padding a row's values
depended on how many rows its step had (a verify segment's rows against a decode row, one batch against
another)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raincheck_core.layers.gdn import rowwise


@pytest.mark.parametrize("fn", [F.softplus, torch.sigmoid])
@pytest.mark.parametrize("heads", [2, 4, 8, 24, 48, 64])
def test_a_rows_gates_do_not_depend_on_the_rows_beside_it(fn, heads):
    x = 3 * torch.randn(9, heads, generator=torch.Generator().manual_seed(heads))
    every = rowwise(fn, x)
    assert every.is_contiguous() and every.shape == x.shape
    torch.testing.assert_close(every, fn(x), rtol=2e-7, atol=0)     # the same function, to the ulp
    for m in range(1, 9):
        assert torch.equal(rowwise(fn, x[:m]), every[:m]), m
        assert torch.equal(rowwise(fn, x[m:m + 1]), every[m:m + 1]), m
