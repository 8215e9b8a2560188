#!/usr/bin/env python
"""Contrastive sentence-embedding training with gradient caching (GradCache, Gao et al. 2021).

A large in-batch-negatives batch (64 queries x 64 passages) is encoded in chunks of
16: a first pass without grad computes every embedding and records each chunk's RNG
state (``RandContext`` as in luyug/GradCache: ``torch.get_rng_state`` and the CUDA
states through ``torch.utils.checkpoint.get_device_states``, replayed under
``torch.random.fork_rng``); the InfoNCE loss over the detached embeddings gives the
embedding gradients; then each chunk is encoded again with grad, under the same
random state (dropout masks match), and back-propagated with its cached gradient.
The encoder is a small BERT built from a ``BertConfig``, run under bf16 autocast.

    python gradcache_contrastive.py --steps 100
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import get_device_states, set_device_states
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertModel


class RandContext:
    def __init__(self, *tensors):
        self.fwd_cpu_state = torch.get_rng_state()
        self.fwd_gpu_devices, self.fwd_gpu_states = get_device_states(*tensors)

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=self.fwd_gpu_devices, enabled=True)
        self._fork.__enter__()
        torch.set_rng_state(self.fwd_cpu_state)
        set_device_states(self.fwd_gpu_devices, self.fwd_gpu_states)

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._fork.__exit__(exc_type, exc_val, exc_tb)
        self._fork = None


class RandomPairs(Dataset):
    """Random (query, positive passage) token pairs in place of MS MARCO."""

    def __init__(self, n, q_len, p_len, vocab_size):
        self.n, self.q_len, self.p_len, self.vocab_size = n, q_len, p_len, vocab_size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        q = torch.randint(1000, self.vocab_size, (self.q_len,), generator=g)
        p = torch.randint(1000, self.vocab_size, (self.p_len,), generator=g)
        q[0] = p[0] = 101  # [CLS]
        return {"q_ids": q, "q_mask": torch.ones_like(q), "p_ids": p, "p_mask": torch.ones_like(p)}


class Encoder(torch.nn.Module):
    def __init__(self, config, pooling="mean"):
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=False)
        self.pooling = pooling

    def forward(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            emb = hidden[:, 0]
        else:
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(emb, dim=-1)


def contrastive_loss(q_reps, p_reps, temperature):
    scores = q_reps.float() @ p_reps.float().t() / temperature
    labels = torch.arange(scores.size(0), device=scores.device)
    return F.cross_entropy(scores, labels)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--q-len", type=int, default=128)
    p.add_argument("--p-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--num-workers", type=int, default=2)
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(42)
    device = torch.device("cuda")

    config = BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=512,
    )
    model = Encoder(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    dataset = RandomPairs(args.batch_size * args.steps, args.q_len, args.p_len, config.vocab_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.num_workers, pin_memory=True)

    def encode(ids, mask):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(ids, mask)

    model.train()
    step = 0
    t0 = time.time()
    while step < args.steps:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            q_chunks = list(zip(batch["q_ids"].split(args.chunk_size), batch["q_mask"].split(args.chunk_size)))
            p_chunks = list(zip(batch["p_ids"].split(args.chunk_size), batch["p_mask"].split(args.chunk_size)))

            # 1. embeddings of every chunk, no graph kept; remember each chunk's random state
            q_reps, p_reps, q_states, p_states = [], [], [], []
            with torch.no_grad():
                for ids, mask in q_chunks:
                    q_states.append(RandContext(ids, mask))
                    q_reps.append(encode(ids, mask))
                for ids, mask in p_chunks:
                    p_states.append(RandContext(ids, mask))
                    p_reps.append(encode(ids, mask))
            q_reps = torch.cat(q_reps).detach().requires_grad_()
            p_reps = torch.cat(p_reps).detach().requires_grad_()

            # 2. the loss over the whole batch, back to the embeddings only
            loss = contrastive_loss(q_reps, p_reps, args.temperature)
            loss.backward()
            q_cache = q_reps.grad.split(args.chunk_size)
            p_cache = p_reps.grad.split(args.chunk_size)

            # 3. each chunk again with grad, under its recorded random state
            for (ids, mask), state, grad in zip(q_chunks + p_chunks, q_states + p_states, list(q_cache) + list(p_cache)):
                with state:
                    emb = encode(ids, mask)
                emb.backward(gradient=grad)

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

            t1 = time.time()
            print(f"step {step}: loss {loss.item():.4f} ({(t1 - t0) * 1000:.0f} ms)")
            t0 = t1
            step += 1
            if step >= args.steps:
                break

    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
          f"reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
