"""The meta-kernel cache: fresh outputs by signature, nothing else."""

import torch

from memprof.meta_kernels import KernelCache

aten = torch.ops.aten


def _count(func, args, kwargs, out):
    return func.__name__


def test_fresh_outputs_are_rebuilt_from_their_layout():
    cache = KernelCache()
    a = torch.empty(512, 256, device="meta")
    b = torch.empty(256, 128, device="meta").t()  # a transposed operand: the key holds strides
    first, v1 = cache.run(aten.mm.default, (a, b.t()), {}, _count)
    second, v2 = cache.run(aten.mm.default, (a, b.t()), {}, _count)
    assert (cache.misses, cache.hits) == (1, 1)
    assert v1 == v2 == "mm.default"
    assert second.shape == first.shape == (512, 128) and second.stride() == first.stride()
    assert second.untyped_storage().nbytes() == 512 * 128 * 4
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata  # a new storage each call


def test_other_shapes_dtypes_and_scalars_miss():
    cache = KernelCache()
    x = torch.empty(4, 8, device="meta")
    cache.run(aten.mul.Scalar, (x, 2), {}, _count)
    cache.run(aten.mul.Scalar, (x, 2.0), {}, _count)  # a float scalar is another argument
    cache.run(aten.mul.Scalar, (x.half(), 2), {}, _count)
    cache.run(aten.mul.Scalar, (torch.empty(8, 4, device="meta"), 2), {}, _count)
    assert (cache.misses, cache.hits) == (4, 0)


def test_views_metadata_changes_out_and_host_tensors_are_not_kept():
    cache = KernelCache()
    x = torch.empty(4, 8, device="meta")
    out = torch.empty(4, 8, device="meta")
    for _ in range(2):
        v, _ = cache.run(aten.view.default, (x, [32]), {}, _count)
        assert v.untyped_storage()._cdata == x.untyped_storage()._cdata
        t = torch.empty(4, 8, device="meta")
        cache.run(aten.t_.default, (t,), {}, _count)  # changes the input's metadata (inplace_view)
        assert t.shape == (8, 4)
        cache.run(aten.add.out, (x, x), {"out": out}, _count)  # out= may resize out
        h, _ = cache.run(aten.add.Tensor, (torch.ones(3), torch.ones(3)), {}, _count)
        assert h.tolist() == [2.0, 2.0, 2.0]  # computed, not rebuilt
    assert cache.hits == 0


def test_in_place_operators_return_their_written_inputs():
    cache = KernelCache()
    x, y = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    for _ in range(2):
        r, v = cache.run(aten.add_.Tensor, (x, y), {}, _count)  # broadcasts y: checked by the first call
        assert r is x and v == "add_.Tensor"
    ps = [torch.empty(3, device="meta"), torch.empty(2, 5, device="meta")]
    for _ in range(2):
        r, v = cache.run(aten._foreach_lerp_.Scalar, (ps, [torch.empty_like(p) for p in ps], 0.1), {}, _count)
        assert r is None and v == "_foreach_lerp_.Scalar"
    assert (cache.misses, cache.hits) == (2, 2)
    # A signature that fails its checks is not kept: the next call fails as well.
    for _ in range(2):
        try:
            cache.run(aten.add_.Tensor, (y, x), {}, _count)  # (8,) += (4, 8) cannot broadcast into y
        except RuntimeError:
            pass
        else:
            raise AssertionError("add_ into a smaller tensor ran")
    assert cache.hits == 2


def test_several_outputs_keep_their_structure():
    cache = KernelCache()
    x = torch.empty(2, 16, 64, device="meta")
    w, b = torch.empty(64, device="meta"), torch.empty(64, device="meta")
    for _ in range(2):
        out, _ = cache.run(aten.native_layer_norm.default, (x, [64], w, b, 1e-5), {}, _count)
        assert isinstance(out, tuple) and [t.shape for t in out] == [(2, 16, 64), (2, 16, 1), (2, 16, 1)]
    assert cache.hits == 1


def test_an_output_that_aliases_an_input_is_not_kept():
    # aten._unsafe_view's schema says nothing of aliasing, but its result shares the input's storage.
    cache = KernelCache()
    x = torch.empty(16, 64, device="meta")
    for _ in range(2):
        v, _ = cache.run(aten._unsafe_view.default, (x, [4, 4, 64]), {}, _count)
        assert v.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 0


def test_a_subclass_is_never_served_from_the_cache():
    """A cached result is rebuilt as a plain meta tensor: for a subclass (a
    DTensor) it would mix plain tensors into the subclass's operators."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    cache = KernelCache()
    mul = torch.ops.aten.mul.Tensor
    assert cache.signature(mul, (a, b), {}) is not None
    assert cache.signature(mul, (TwoTensor(a, b), b), {}) is None
    for _ in range(2):
        out, _ = cache.run(mul, (TwoTensor(a, b), 2), {}, lambda *args: None)
        assert type(out) is TwoTensor
