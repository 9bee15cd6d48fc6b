"""The paged-attention kernels' autotune pruning (folio/model/attention/triton_kernels.py):
at MLA's wide heads (576, padded to 1024) only configs whose tiles fit the H200's shared
memory are tried (all of the usual ones overflowed it: 384 KiB asked, 227 KiB there); at the
usual head dims the tuned set stays as it was."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


def _configs(kernel) -> list:
    return list(kernel.configs)


def _smem(config, rows: int, d_pad: int, elem: int) -> int:
    return elem * d_pad * (rows + 2 * config.kwargs["BLOCK_N"] * max(1, config.num_stages))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wide_heads_keep_only_configs_that_fit(dtype) -> None:
    from folio.model.attention import triton_kernels as tk
    if tk.INTERPRET:
        pytest.skip("the interpreter has one config")
    q = torch.empty(1, 16, 576, dtype=dtype)
    elem = q.element_size()
    varlen = tk._prune_varlen(_configs(tk._varlen_kernel), {"Q": q}, G_PAD=16, D_PAD=1024)
    assert varlen and all(_smem(c, c.kwargs["BLOCK_M"], 1024, elem) <= tk._SMEM_BUDGET
                          for c in varlen)
    assert all(c.kwargs["BLOCK_M"] >= 16 for c in varlen)
    decode = tk._prune_decode(_configs(tk._decode_kernel), {"Q": q}, G_M=16, D_PAD=1024)
    assert decode and all(_smem(c, 16, 1024, elem) <= tk._SMEM_BUDGET for c in decode)


def test_usual_heads_keep_the_tuned_set() -> None:
    from folio.model.attention import triton_kernels as tk
    if tk.INTERPRET:
        pytest.skip("the interpreter has one config")
    q = torch.empty(1, 8, 128, dtype=torch.bfloat16)
    varlen = tk._prune_varlen(_configs(tk._varlen_kernel), {"Q": q}, G_PAD=4, D_PAD=128)
    assert varlen and all(c.num_stages > 1 for c in varlen)
    assert len(varlen) == 7   # the seven tuned configs, none of the wide-head ones
    decode = tk._prune_decode(_configs(tk._decode_kernel), {"Q": q}, G_M=16, D_PAD=128)
    assert len(decode) == 5
