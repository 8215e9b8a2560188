"""memprof.values: the simulated GPU follows the values of small tensors, and only those."""

import pytest
import torch

from memprof.aten_args import tensors
from memprof.values import LIMIT, UnknownValues, Values
from memprof.virtual_cuda import VirtualCUDA


def test_small_tensors_keep_their_values_through_ops_views_and_in_place_updates():
    with VirtualCUDA("h200") as gpu:
        ids = torch.tensor([[3, 0, 5], [0, 0, 7]]).cuda()  # from the host
        mask = ids != 0
        assert ids.is_meta and mask.tolist() == [[True, False, True], [False, False, True]]
        row = ids[1]  # a view shares its storage's shadow
        row.add_(1)
        assert ids.tolist() == [[3, 0, 5], [1, 1, 8]]
        assert ids[mask].tolist() == [3, 5, 8]  # boolean indexing: a value-shaped op, run on the shadows
        assert ids[ids != 0].tolist() == [3, 5, 1, 1, 8]
        assert mask.nonzero().shape == (3, 2)
        assert float(torch.full((), 0.0, device="cuda")) == 0.0  # a GradScaler's found-inf flag
        assert gpu.values.shadow(torch.arange(4, device="cuda")).tolist() == [0, 1, 2, 3]
        host = torch.zeros(3, dtype=torch.long)
        assert host.copy_(torch.arange(3, device="cuda")).tolist() == [0, 1, 2]  # a copy to the host


def test_data_made_on_the_device_keeps_its_values_and_takes_its_memory():
    """``torch.tensor(data, device="cuda")``: C++ fills a host tensor and moves it with the
    dispatch modes out of sight; the simulated GPU moves it in their sight instead."""
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator

    allocator = SimulatedAllocator(get_gpu("h100"))
    with VirtualCUDA("h100", allocator=allocator):
        labels = torch.tensor([3, 1, 2], device="cuda")
        assert labels.is_meta and labels.tolist() == [3, 1, 2] and torch.as_tensor([4], device="cuda").item() == 4
        weight = torch.tensor([[0.5] * 256] * 1024, device="cuda", requires_grad=True)  # 1 MiB
        assert weight.is_leaf and weight.requires_grad
        assert torch.cuda.memory_allocated() == 512 + (1 << 20)  # the labels take a 512-byte block


def test_values_with_cuda_as_the_default_device():
    """``torch.set_default_device("cuda")`` (the simulated GPU's meta): the values' host
    copies stay on the host, and data made without a device argument keeps its values."""
    with VirtualCUDA("h100") as gpu:
        torch.set_default_device("cuda")
        try:
            labels, steps = torch.tensor([3, 1]), torch.arange(3)
            assert labels.is_meta and labels.tolist() == [3, 1] and steps.tolist() == [0, 1, 2]
            big = torch.empty(LIMIT, dtype=torch.uint8)  # unknown: the placeholder ones, on the host
            assert gpu.values.shadow(big) is None and big[:2].tolist() == [1, 1]
        finally:
            torch.set_default_device("cpu")


def test_writes_that_cannot_be_followed_drop_the_values():
    with VirtualCUDA("h200") as gpu:
        small = torch.zeros(4, device="cuda")
        big = torch.ones(LIMIT // 4 + 1, device="cuda")  # one float over the limit: no values
        assert gpu.values.shadow(big) is None and gpu.values.shadow(small) is not None
        small.copy_(big[:4])  # written from unknown values
        assert gpu.values.shadow(small) is None
        assert small.sum().item() == 1.0  # the placeholder for unknown values


def test_a_large_factory_is_never_computed_on_the_host():
    """A factory has no inputs whose values could be unknown: its size decides. A batch of
    2^40 random floats (4 TiB) is made on the simulated GPU at once, and a small one still
    gets its values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostWork(TorchDispatchMode):  # below the simulated GPU: sees what it asks of the host
        sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.sizes += [t.numel() * t.element_size() for t in tensors(out) if not t.is_meta]
            return out

    with HostWork(), VirtualCUDA("h200") as gpu:
        huge = torch.randn(4096, 4096, device="cuda")  # 64 MiB, as a batch of inputs
        ones = torch.ones(2**40, device="cuda").reshape(2**20, 2**20)
        assert huge.shape == (4096, 4096) and ones.shape == (2**20, 2**20)
        assert gpu.values.shadow(huge) is None and gpu.values.shadow(ones) is None
        assert torch.ones(LIMIT // 4, device="cuda").sum().item() == LIMIT // 4
    assert max(HostWork.sizes) == LIMIT  # the small one's values


def test_value_shaped_ops_on_unknown_values_take_their_upper_bound():
    """A mask, nonzero or unique of values the simulation does not follow (a metric's
    ``pred[valid]``, torchvision's detection heads): sized for every element selected;
    integer indices (``x[scores.topk(k).indices]``) by their shapes, as on the GPU."""
    with VirtualCUDA("h200") as gpu:
        big = torch.randn(LIMIT, device="cuda")  # 4 MiB: not followed
        assert big[big > 0].shape == (LIMIT,)
        assert gpu.notes["upper bound: x[mask]"] == "on values not followed, sized as if every element were selected"
        assert big.view(1024, -1)[big.view(1024, -1)[:, 0] > 0].shape == (1024, LIMIT // 1024)
        assert big.nonzero().shape == (LIMIT, 1) and torch.where(big.view(2, -1) > 0)[1].shape == (LIMIT,)
        assert torch.masked_select(big, big > 0).shape == (LIMIT,)
        out, inverse, counts = torch.unique(big.long(), return_inverse=True, return_counts=True)
        assert (out.shape, inverse.shape, counts.shape) == ((LIMIT,), (LIMIT,), (LIMIT,))
        assert big[big.topk(10).indices].shape == (10,)
        assert torch.bincount(big.long(), minlength=1000).shape == (1000,)  # the values taken below it
        with pytest.raises(UnknownValues, match=r"aten.bincount makes an output whose shape depends"):
            torch.bincount(big.long())


def test_ctc_sizes_log_alpha_by_the_longest_target_it_is_given():
    """CUDA's CTC kernel (LossCTC.cu) takes batch x input length x (2 x the longest target + 1) for
    log_alpha; F.ctc_loss hands it the lengths as integers. With 1-D targets (every sample's
    concatenated, deepspeech's habit) the simulation took all of them for one target: 961 where
    the lengths say 61, 15.7 times log_alpha's bytes; lengths in host tensors (PyTorch's own
    example) stopped the simulation ("Tensor on device cpu is not on the expected device meta").
    Lengths of aten's tensor overload keep the bound."""
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator

    with VirtualCUDA("h200", allocator=SimulatedAllocator(get_gpu("h200"))):
        log_probs = torch.randn(200, 16, 32, device="cuda").log_softmax(-1)  # 400 KiB: not followed
        targets = torch.randint(1, 32, (16 * 30,), device="cuda")
        lengths = [30] * 16
        _, log_alpha = torch.ops.aten._ctc_loss(log_probs, targets, [200] * 16, lengths)
        assert log_alpha.shape == (16, 200, 2 * 30 + 1)
        before = torch.cuda.memory_allocated()
        loss = torch.nn.functional.ctc_loss(log_probs, targets, torch.full((16,), 200), torch.tensor(lengths))
        assert torch.cuda.max_memory_allocated() - before >= 16 * 200 * 61 * 4 and loss.shape == ()
        _, bound = torch.ops.aten._ctc_loss(log_probs, targets.view(16, 30), torch.full((16,), 200, device="cuda"),
                                            torch.full((16,), 30, device="cuda"))
        assert bound.shape == (16, 200, 61)  # the padded width of 2-D targets


def test_a_known_mask_sizes_its_selection_of_unknown_values():
    """x[mask] and masked_select where the mask's values are known and x's are not (SimCLR's
    similarity matrix of features without its diagonal, a label matrix's positives): the mask
    alone decides the size, exactly, and no upper bound is noted."""
    with VirtualCUDA("h200") as gpu:
        features = torch.randn(LIMIT, device="cuda").view(1024, 1024)  # 4 MiB: not followed
        eye = torch.eye(1024, dtype=torch.bool, device="cuda")  # 1 MiB: followed
        assert features[~eye].shape == (1024 * 1023,)
        assert features[~eye].view(1024, -1).shape == (1024, 1023)
        labels = torch.arange(8, device="cuda") % 4
        positives = labels[None] == labels[:, None]  # 8 x 8, 16 true
        assert features[:8, :8][positives].shape == (16,)
        assert torch.masked_select(features[:8, :8], positives[0]).shape == (8 * 2,)  # broadcast over rows
        assert features[eye[0]].shape == (1, 1024)
        assert not any(k.startswith("upper bound") for k in gpu.notes)


def test_truths_the_step_branches_on_from_values_not_followed():
    """A mixture's router skips experts with `if not mask.any(): continue`, where the mask
    comes from a large tensor's argmax: every expert was skipped (made-up False), so their
    activations and optimizer state vanished. any() of values not followed is now true (all()
    stays false, as any other made-up truth: a decoding loop runs to its length); a NaN check
    finds none, a finiteness check passes; both noted for the report."""
    with VirtualCUDA("h200") as gpu:
        logits = torch.randn(LIMIT, 4, device="cuda")  # 16 MiB: not followed
        mask = logits.argmax(-1) == 2
        assert gpu.values.shadow(mask) is None
        # bool() of each, then compared: an assert on a made-up truth is a check, which passes
        assert [bool(mask.any()), bool(mask.all()), (logits >= 0).any().item()] == [True, False, True]
        assert gpu.values.shadow(mask.view(-1, 4).any(dim=0)) is None  # over a dimension: not assumed
        loss = logits.square().mean()
        assert [bool(torch.isnan(loss)), bool(torch.isinf(loss)), bool(torch.isfinite(loss))] == [False, False, True]
        assert not bool(torch.isnan(loss).logical_or(torch.isinf(loss)))  # clip_grad_norm_'s check
        # too large for a shadow
        assert [bool(torch.isnan(logits).any()), bool((~torch.isfinite(logits)).any())] == [False, False]
        assert [bool(torch.isfinite(logits).all()), bool(torch.isinf(logits).all())] == [True, False]
        assert "any()" in gpu.notes and "finite values" in gpu.notes
        known = torch.tensor([0.0, float("nan")], device="cuda")
        assert torch.isnan(known).any() and not torch.isfinite(known).all()  # known values: their answer


def test_a_check_on_values_not_followed_passes():
    """DETR's box check, `if not (boxes[:, 2:] >= boxes[:, :2]).all(): raise ValueError`, read
    the made-up False of all() and stopped the script; `if (x < 0).any(): raise` likewise read
    any()'s True. A truth whose one branch raises at once is answered as passing; any other
    test keeps the made-up answer (a loop's `if done.all(): break` runs on, a router's
    `if not mask.any(): continue` routes); known values keep theirs (a check that fails on
    the script's own values raises as on a GPU)."""

    script = {"torch": torch}  # compiled as a script is, not rewritten by pytest's asserts
    exec(compile("""
def checked(boxes):
    if not (boxes[:, 2:] >= boxes[:, :2]).all():
        raise ValueError(f"boxes must be in corner format, got {boxes}")
    assert (boxes >= 0).all(), "negative coordinates"
    if (boxes > 1).any():
        raise ValueError("boxes must be normalized")
    if not (boxes[:, 2:] > boxes[:, :2]).all().item():
        raise ValueError("empty boxes")
    torch._assert((boxes <= 1).all(), "boxes above 1")
    return "passed"
""", "script.py", "exec"), script)
    checked = script["checked"]

    with VirtualCUDA("h200") as gpu:
        boxes = torch.rand(LIMIT, 4, device="cuda")  # 16 MiB: not followed
        assert gpu.values.shadow(boxes >= 0) is None
        assert checked(boxes) == "passed" and "checks" in gpu.notes
        steps, done = 0, boxes[:, 0] > 2
        for _ in range(5):
            steps += 1
            if done.all():
                break
        routed = 0
        for expert in range(4):
            if not (boxes.argmax(-1) == expert).any():
                continue
            routed += 1
        assert (steps, routed) == (5, 4)
        with pytest.raises(ValueError, match="normalized"):
            checked(torch.tensor([[0.0, 0.0, 2.0, 2.0]], device="cuda"))


def test_a_router_of_values_not_followed_spreads_tokens_evenly():
    """A mixture's router picks experts by values the simulation does not follow. Sized for
    its upper bound, every expert took every token (Hugging Face's Mixtral block: torch.where
    over a one-hot of the top-k, k x N tokens an expert, E times too many); the indices of
    topk and argmax are now spread evenly, each row's k distinct: N k / E tokens an expert."""
    n, e, k = 4096, 8, 2
    with VirtualCUDA("h200") as gpu:
        hidden = torch.randn(n, 1024, device="cuda")  # 16 MiB: not followed
        logits = hidden[:, :e] * 1.0
        stable = logits - logits.max(-1, keepdim=True).values  # a stable softmax's max: its indices unused
        assert "topk, argmax" not in gpu.notes  # nothing was made up that the step reads
        weights, selected = torch.topk(logits.softmax(-1), k, dim=-1)
        assert gpu.values.shadow(weights) is None  # the weights stay unknown
        expert_mask = torch.nn.functional.one_hot(selected, num_classes=e).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        assert hit.shape == (e, 1)
        for expert in range(e):
            idx, top_x = torch.where(expert_mask[expert])
            assert top_x.shape == (n * k // e,)
            assert hidden[None, top_x].reshape(-1, 1024).shape == (n * k // e, 1024)
        assert (selected[:, 0] != selected[:, 1]).all()  # two distinct experts a token
        switch = logits.argmax(-1)  # top-1 routing
        assert [int((switch == x).sum()) for x in range(e)] == [n // e] * e
        assert logits.max(dim=-1).indices.shape == (n,) and hidden.argmax().item() == 0
        assert "topk, argmax" in gpu.notes and not any(key.startswith("upper bound") for key in gpu.notes)


def test_samplers_without_meta_kernels():
    """torch.distributions' Beta, Dirichlet and Binomial sample with kernels that have no meta
    implementation; a check inside a kernel (istft's) reads values through C++'s item()."""
    with VirtualCUDA("h200"):
        one = torch.ones(600, 600, device="cuda")  # 1.4 MiB: not followed
        assert torch.distributions.Beta(one, one).sample().shape == (600, 600)
        assert torch.distributions.Dirichlet(one).sample().shape == (600, 600)
        assert torch.distributions.Binomial(10, probs=one / 2).sample().shape == (600, 600)
        window = torch.hann_window(512, device="cuda")
        spec = torch.stft(torch.randn(8, 16000, device="cuda"), 512, 128, window=window, return_complex=True)
        assert torch.istft(spec, 512, 128, window=window).shape == (8, 16000)  # centred: as long as the input


def test_host_work_is_left_alone():
    values = Values()
    with values:
        x = torch.arange(6).reshape(2, 3)
        assert x[x > 2].tolist() == [3, 4, 5]
    assert values._shadows == {}


def test_an_output_whose_elements_share_memory_gets_no_shadow():
    """An empty tensor made with a zero stride (an expanded layout, as activation offload
    restores one) cannot hold one value per element: it is simply not followed."""
    from memprof.devices import get_gpu
    from memprof.virtual_cuda import VirtualCUDA

    with VirtualCUDA(get_gpu("h100")) as vc:
        t = torch.empty_strided((4, 8), (0, 1), device="meta")
        assert t.shape == (4, 8) and vc.values.shadow(t) is None


def test_uninitialised_memory_has_no_values_until_every_element_is_written(monkeypatch):
    """``torch.empty`` holds whatever the memory held: not followed (a kernel reading such
    values on the host, max-pooling's backward with indices an offloaded activation left
    empty, read out of bounds). Filled or copied into whole, it is known again; a partial
    write leaves it unknown."""
    with VirtualCUDA("h200") as gpu:
        t = torch.empty(4, device="cuda")
        assert gpu.values.shadow(t) is None and gpu.values.shadow(torch.empty_like(t)) is None
        t.fill_(2.0)
        assert gpu.values.shadow(t).tolist() == [2.0] * 4
        u = torch.empty(2, 3, dtype=torch.long, device="cuda")
        u.copy_(torch.arange(6).reshape(2, 3))  # from the host
        assert (u + 1).tolist() == [[1, 2, 3], [4, 5, 6]]
        v = torch.empty(4, device="cuda")
        v[:2].fill_(1.0)
        assert gpu.values.shadow(v) is None
        w = torch.nn.Linear(4, 2, device="cuda").weight  # made empty, then drawn at random
        assert -0.5 <= gpu.values.shadow(w).min() and gpu.values.shadow(w).max() <= 0.5  # kaiming_uniform_'s bound
        big = torch.empty(LIMIT // 4 + 1, device="cuda")  # one float over the limit: never followed,
        made = []  # nor written on the host (a 7B model's initialisation would run there)
        zeros = torch.zeros
        monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or zeros(*a, **k))
        big.fill_(1.0)
        assert gpu.values.shadow(big) is None and made == []


def test_torchvision_detection_ops_under_autocast():
    """torchvision's roi_align and nms run as their autocast kernels do (inputs cast to float32,
    roi_align's output back to the features' dtype; Mask R-CNN stopped: "Expected tensor for input
    to have the same type as tensor for rois"); nms of boxes scored by the model keeps every box."""
    torchvision = pytest.importorskip("torchvision")
    with VirtualCUDA("h200"), torch.autocast("cuda", dtype=torch.float16):
        features = torch.nn.Conv2d(256, 256, 3, padding=1).cuda()(torch.randn(2, 256, 64, 64, device="cuda"))
        rois = torch.rand(512, 5, device="cuda") * 64
        pooled = torchvision.ops.roi_align(features, rois, (7, 7), 0.25, 2)
        assert features.dtype is torch.float16 and (pooled.dtype, pooled.shape) == (torch.float16, (512, 256, 7, 7))
        boxes = torch.rand(40000, 4, device="cuda")  # 625 KiB: followed, but scores from the model are not
        scores = torch.nn.Linear(256, 1).cuda()(torch.randn(40000, 256, device="cuda")).squeeze(1)
        assert torchvision.ops.nms(boxes, scores.float(), 0.7).shape == (40000,)


def test_a_sparse_adjacency_built_by_the_script():
    """A graph's adjacency as a sparse COO tensor, coalesced and multiplied (a GCN by hand):
    PyTorch's meta kernels have no sparse ``_coalesce`` or ``addmm``; the dense results as
    cuSPARSE writes them, the coalesced tensor as large as the uncoalesced one."""
    with VirtualCUDA("h200"):
        edges = torch.randint(0, 100_000, (2, 500_000), device="cuda")  # 8 MB: values not followed
        adj = torch.sparse_coo_tensor(edges, torch.ones(500_000, device="cuda"), (100_000, 100_000)).coalesce()
        assert adj.is_coalesced() and adj._nnz() == 500_000
        w = torch.randn(64, 32, device="cuda", requires_grad=True)
        h = torch.sparse.mm(adj, torch.randn(100_000, 64, device="cuda") @ w)
        assert h.shape == (100_000, 32) and (adj @ h).shape == (100_000, 32)
        h.sum().backward()  # the dense operand's gradient: adj.t() @ grad
        assert w.grad.shape == (64, 32)


def test_an_index_copied_from_the_host_keeps_its_values():
    """A graph batch's node-to-graph index (150,000 int64, 1.2 MB: over the 1 MiB followed) comes
    from the host, where its values are: ``batch.max() + 1`` graphs is 300, not a made-up 2 (the
    pooled graphs then did not match the 300 labels)."""
    with VirtualCUDA("h200") as device:
        batch = torch.arange(300).repeat_interleave(500).to("cuda")
        assert int(batch.max()) + 1 == 300 and torch.bincount(batch).shape == (300,)
        on_device = torch.empty(150_000, dtype=torch.long, device="cuda")
        on_device.copy_(torch.arange(150_000) % 7)
        assert int(on_device.max()) == 6
        floats = torch.randn(512, 1024).to("cuda")  # 2 MiB of floats: not followed
        assert device.values.shadow(floats) is None and device.values.shadow(batch) is not None


def test_the_largest_of_tokens_not_followed_is_not_known():
    """Hugging Face's sampling loop stops when ``unfinished_sequences.max() == 0``: for sampled
    tokens (values not followed) that is not known, so it goes on, where a made-up 0 (max taken
    for an argmax, its index spread) stopped it after one token."""
    with VirtualCUDA("h200"):
        probs = torch.softmax(torch.randn(4, 300_000, device="cuda"), -1)
        tokens = torch.multinomial(probs, 1).squeeze(1)  # sampled: unknown
        unfinished = torch.ones(4, dtype=torch.long, device="cuda") & (tokens != 2).long()
        assert not bool(unfinished.max() == 0)
        values, indices = probs.max(-1)  # max over a dimension: its indices are spread as argmax's
        assert indices.tolist() == [0, 1, 2, 3]


def test_a_criterion_met_is_known_whatever_it_is_ored_with():
    """Hugging Face's generate() ORs its max-length check (known) with an end-of-sequence check
    on tokens picked from large logits (unknown) and stops once every sequence is done: it never
    stopped, bool() of an unknown tensor being False."""
    with VirtualCUDA("h200"):
        tokens = torch.randn(4, 300_000, device="cuda").argmax(-1)  # from 4.6 MiB of logits: unknown
        eos = tokens == 2
        done = torch.full((4,), True, device="cuda") | eos
        assert bool(done.all())
        unfinished = torch.ones(4, dtype=torch.bool, device="cuda") & ~eos  # unknown
        unfinished &= ~done
        assert unfinished.max().item() == 0
        # generate()'s own, under inference_mode (where `&` reaches the modes as aten.__and__, not decomposed)
        with torch.inference_mode():
            done = torch.full((4,), True, device="cuda") | eos
            unfinished = torch.ones(4, dtype=torch.long, device="cuda") * (~eos).long()  # unknown
            assert (unfinished & ~done).max().item() == 0
        assert not bool((torch.full((4,), False, device="cuda") | eos).all())  # unknown: bool() is False


def test_a_factorization_of_values_not_followed_succeeds():
    """GPyTorch's psd_safe_cholesky runs cholesky_ex and adds jitter while its info is not 0
    (then raises NotPSDError): info of a matrix whose values are not followed was any()'s
    "true" and item()'s made-up 1, so every try failed and the step stopped. It is 0 now, a
    well-conditioned matrix's, and the loop goes on at its first try."""
    with VirtualCUDA("h200"):
        x = torch.randn(2048, 64, device="cuda")
        a = x @ x.T + torch.eye(2048, device="cuda")  # 16 MiB: values not followed
        tries = 0
        for jitter in (1e-6, 1e-5, 1e-4):
            tries += 1
            factor, info = torch.linalg.cholesky_ex(a + jitter * torch.eye(2048, device="cuda"))
            if not torch.any(info):
                break
        assert tries == 1 and info.item() == 0 and factor.shape == (2048, 2048)
        inverse, info = torch.linalg.inv_ex(a)
        assert not bool(info) and inverse.is_meta
