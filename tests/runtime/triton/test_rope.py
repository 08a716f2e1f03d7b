"""RoPE kernel: in-place rotation equals out-of-place, and the transposed rotation undoes it."""
from __future__ import annotations

import torch

from rtxops.runtime.ops.rope import _cos_sin, cases

from .test_kernels import small_cases


def test_small_cases_cover_both_layouts_gqa_trig_grads_and_strides():
    names = {name for name, _, _ in small_cases("rope", torch.float32)}
    assert {"bhsd", "bshd_unsqueeze2", "gqa_fewer_k_heads", "cos_sin_grad",
            "non_contiguous_bhsd_from_bshd", "odd_sizes"} <= names, names
    assert len(names) == len(cases(torch.float32))


def test_rotation_in_place_equals_out_of_place_and_transpose_inverts_it():
    from rtxops.runtime.ops.triton._report import Reporter
    from rtxops.runtime.ops.triton.rope import rotate

    config = {"num_warps": 4}
    reporter = Reporter("rope", "triton", "test", config, config)
    g = torch.Generator().manual_seed(0)
    for layout, shape in ((1, (2, 3, 5, 12)), (2, (2, 5, 3, 12))):
        x = torch.randn(*shape, generator=g)
        cos, sin = _cos_sin(5, 12, torch.float32, "cpu")
        out = rotate(x, torch.empty_like(x), cos, sin, layout, False, config, reporter)
        in_place = x.clone()
        rotate(in_place, in_place, cos, sin, layout, False, config, reporter)
        assert torch.equal(in_place, out)
        assert not torch.allclose(out, x)
        back = rotate(out, torch.empty_like(out), cos, sin, layout, True, config, reporter)
        torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
