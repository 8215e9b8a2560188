"""A Hugging Face transformers causal language model, trained with a plain loop.

The model is built from a config (no download); the loss comes from the
model itself (``labels=``), as in most Hugging Face training code.

    python examples/train_hf.py --steps 3
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=4096, n_positions=args.seq)
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
