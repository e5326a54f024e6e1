"""Batch-first trees: row selection is plain indexing that keeps a tensor's memory format, over nested inputs."""
import pytest
import torch

from learn2stop.core.trees import take_rows, tree_select


def test_take_rows_is_indexing_and_keeps_the_memory_format():
    x = torch.randn(6, 5)
    idx = torch.tensor([4, 0, 2])
    mask = torch.tensor([True, False, True, False, False, True])
    assert torch.equal(take_rows(x, idx), x[idx]) and torch.equal(take_rows(x, mask), x[mask])
    assert take_rows(x, slice(1, 3)).data_ptr() == x[1:].data_ptr()  # a slice stays a view
    img = torch.randn(6, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    vol = torch.randn(6, 3, 2, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    for a, fmt in ((img, torch.channels_last), (vol, torch.channels_last_3d)):
        for i in (idx, mask, torch.tensor([], dtype=torch.long)):
            out = take_rows(a, i)
            assert torch.equal(out, a[i]) and out.is_contiguous(memory_format=fmt)
    odd = torch.randn(4, 6, 5).transpose(0, 1)  # neither layout: plain indexing
    assert torch.equal(take_rows(odd, idx), odd[idx])
    with pytest.raises(IndexError):  # a mask of another length: indexing's own error, not a silent subset
        take_rows(x, mask[:4])
    tree = {"a": x, "b": (img, torch.tensor(3.0))}
    got = tree_select(tree, idx)
    assert torch.equal(got["a"], x[idx]) and torch.equal(got["b"][0], img[idx]) and got["b"][1] == 3.0
