# Decoder-only LM trained with hand-written activation offloading, torchtune habits:
# a saved_tensors_hooks subclass (torchtune's OffloadActivations) whose pack hook copies
# saved activations into pinned host buffers on a side CUDA stream (event / wait_stream
# synchronised, a small forward stash keeping the source alive until the copy is done) and
# whose unpack hook brings them back non_blocking on that stream (record_stream where an
# output aliases the brought-back tensor); a NoOpManager around the output projection
# (torchtune keeps the logits' input on the GPU); non-reentrant checkpointing of every
# other block; bf16 weights, fused AdamW, SDPA, RMSNorm, SwiGLU; per-step peak memory.
#
# OFFLOAD_TINY=1 runs a tiny configuration on the CPU (no streams, no pinning) as a check.
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

TINY = os.environ.get("OFFLOAD_TINY") == "1"


@dataclass
class Config:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    hidden_dim: int = 5632
    seq_len: int = 2048
    batch_size: int = 4
    norm_eps: float = 1e-5
    lr: float = 3e-4
    steps: int = 5


class OffloadActivations(saved_tensors_hooks):
    """Saved activations of at least ``min_offload_size`` bytes go to (pinned) host memory in
    forward and come back in backward, optionally overlapped on a side stream."""

    def __init__(self, use_pin_memory=True, use_streams=True, max_fwd_stash_size=5, min_offload_size=1024):
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_offload_size = min_offload_size
        self.tracker = {}          # id -> (tensor, offloaded?)
        self.next_id = 0
        self.first_forward_call = True
        self.first_backward_call = True
        if use_streams:
            self.s0 = torch.cuda.default_stream()
            self.s1 = torch.cuda.Stream()
            self.fwd_stash = {}     # id -> (device activation, event)
            self.bwd_tensor_stash = {}
            self.bwd_ev_stash = {}
            self.curr_graph_id = None
            self.curr_autograd_node = None
        super().__init__(self._pack, self._unpack_streams if use_streams else self._unpack_simple)

    def _pack(self, activation):
        if self.first_forward_call:
            assert not self.tracker, "backward should have emptied the tracker"
            self.first_forward_call = False
            self.first_backward_call = True
        self.next_id += 1
        tid = self.next_id
        nbytes = activation.element_size() * activation.nelement()
        if nbytes < self.min_offload_size or isinstance(activation, (nn.Parameter, nn.Buffer)):
            self.tracker[tid] = (activation, False)
            return tid
        if self.use_streams:
            # Drop the device copies whose host copies are old enough to be done.
            for old in list(self.fwd_stash):
                if old > tid - self.max_fwd_stash_size:
                    break
                _, ev = self.fwd_stash.pop(old)
                self.s0.wait_event(ev)
            self.s1.wait_stream(self.s0)
        stream = self.s1 if self.use_streams else torch.cuda.current_stream() if torch.cuda.is_available() else None
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            host = torch.empty_like(activation, pin_memory=self.use_pin_memory, device="cpu")
            host.copy_(activation, non_blocking=True)
        self.tracker[tid] = (host, True)
        if self.use_streams:
            event = self.s1.record_event()
            self.fwd_stash[tid] = (activation, event)
        return tid

    def _begin_backward(self):
        if self.first_backward_call:
            self.first_backward_call = False
            self.first_forward_call = True
            return True
        return False

    def _unpack_simple(self, tid):
        self._begin_backward()
        t, offloaded = self.tracker.pop(tid)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return t.to(device, non_blocking=True) if offloaded else t

    def _unpack_streams(self, tid):
        if self._begin_backward():
            self.curr_graph_id = torch._C._current_graph_task_id()

            def wait_and_del_remaining_references():
                for i in list(self.bwd_tensor_stash):
                    self.s1.wait_event(self.bwd_ev_stash[i])
                    del self.bwd_tensor_stash[i]

            torch.autograd.variable.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)

        t, offloaded = self.tracker.pop(tid)
        if not offloaded:
            return t
        graph_id = torch._C._current_graph_task_id()
        node = torch._C._current_autograd_node()
        prev_node_ids = []
        if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
            self.curr_autograd_node = node
            prev_node_ids = list(self.bwd_tensor_stash)

        brought_back = True
        if tid in self.fwd_stash:  # still on the device: no copy needed
            t = self.fwd_stash[tid][0]
            brought_back = False
        else:
            with torch.cuda.stream(self.s1):
                t = t.to("cuda", non_blocking=True)
            self.s0.wait_stream(self.s1)
            self.bwd_tensor_stash[tid] = t

        def hook(outputs, inputs):
            if brought_back:
                unpacked = self.bwd_tensor_stash[tid]
                if any(o is not None and o.untyped_storage() is unpacked.untyped_storage() for o in outputs):
                    unpacked.record_stream(self.s0)
                    del self.bwd_tensor_stash[tid]
                else:
                    self.bwd_ev_stash[tid] = self.s0.record_event()
            for i in list(self.fwd_stash):
                _, ev = self.fwd_stash.pop(i)
                self.s0.wait_event(ev)
            for i in prev_node_ids:
                self.s1.wait_event(self.bwd_ev_stash[i])
                del self.bwd_tensor_stash[i]
            return outputs

        node.register_hook(hook)
        return t


class NoOpManager(saved_tensors_hooks):
    """Saved tensors stay as they are (turns an outer offloading context off for a region)."""

    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.normalized_shape = (dim,)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # torchtune: normalise in fp32, cast back, then scale
        x_normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).type_as(x)
        return x_normed * self.scale


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.output_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.sa_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x):
        h = x + self.attn(self.sa_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    def __init__(self, cfg, checkpoint_every=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.checkpoint_every = checkpoint_every

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if self.training and i % self.checkpoint_every == 0:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


def offloading_context(model, use_streams, use_pin_memory):
    """torchtune's get_act_offloading_ctx_manager: offload everything but the output projection's input."""
    ctx = OffloadActivations(use_pin_memory=use_pin_memory, use_streams=use_streams)
    noop = NoOpManager()
    model.output.register_forward_pre_hook(lambda *args: noop.__enter__())
    model.output.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)
    return ctx


def main():
    if TINY:
        cfg = Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, hidden_dim=176, seq_len=32, batch_size=2, steps=3)
        device, dtype, cuda = torch.device("cpu"), torch.float32, False
    else:
        import argparse

        p = argparse.ArgumentParser()
        for f in ("dim", "n_layers", "n_heads", "hidden_dim", "seq_len", "batch_size", "vocab_size", "steps"):
            p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(Config, f))
        cfg = Config(**vars(p.parse_args()))
        device, dtype, cuda = torch.device("cuda"), torch.bfloat16, True
    torch.manual_seed(0)

    model = TransformerDecoder(cfg).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params / 1e6:.1f}M")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=cuda)
    act_ctx = offloading_context(model, use_streams=cuda, use_pin_memory=cuda)

    model.train()
    for step in range(cfg.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), device=device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with act_ctx:
            logits = model(inputs)
        # torchtune upcasts the logits for the loss
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"step {step}: loss {loss.item():.4f} peak {peak:.2f} GiB "
                  f"({time.perf_counter() - t0:.2f}s)")
        else:
            print(f"step {step}: loss {loss.item():.4f}")
    assert not act_ctx.tracker, "every offloaded activation was unpacked"


if __name__ == "__main__":
    main()
