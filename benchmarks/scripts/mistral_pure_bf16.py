"""Pre-train a small Mistral-style decoder from scratch on random tokens.

Follows the habits of many HF "train from scratch" examples: config built in
code, pure bf16 weights, fused AdamW, cosine schedule with warmup, and
non-reentrant gradient checkpointing.
"""
import argparse
import math
import time

import torch
from transformers import AutoModelForCausalLM, MistralConfig, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--sliding-window", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


def get_batch(args, device):
    x = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)
    return x, x.clone()


def main():
    args = parse_args()
    torch.manual_seed(0)
    device = "cuda"

    config = MistralConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.seq_len * 4,
        sliding_window=args.sliding_window,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16)
    model.to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params: {n_params / 1e6:.1f}M")

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    t0 = time.time()
    for step in range(args.max_steps):
        input_ids, labels = get_batch(args, device)
        out = model(input_ids=input_ids, labels=labels)
        loss = out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            torch.cuda.synchronize()
            dt = time.time() - t0
            t0 = time.time()
            print(f"step {step} loss {loss.item():.4f} ppl {math.exp(min(loss.item(), 20)):.1f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} dt {dt:.2f}s "
                  f"mem {torch.cuda.max_memory_allocated() / 2**30:.2f}GiB")


if __name__ == "__main__":
    main()
