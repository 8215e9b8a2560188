#!/usr/bin/env python
"""
Train a Llama-style decoder with grouped-query attention on random tokens.

A plain PyTorch training loop around a Hugging Face `LlamaForCausalLM` built from a
config (no pretrained weights). Useful as a quick throughput / sanity check of a
training setup before plugging in a real dataset.

Example:

    python gqa_decoder.py --dtype bfloat16 --batch-size 4 --seq-len 2048 --steps 6
"""

import argparse
import logging
import math
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler, set_seed

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Train a GQA Llama decoder on random tokens.")
    # model
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12, help="Number of hidden layers.")
    parser.add_argument("--heads", type=int, default=16, help="Number of attention heads.")
    parser.add_argument("--kv-heads", type=int, default=4, help="Number of key/value heads (GQA).")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    # data
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--attention-mask",
        action="store_true",
        help="Pass an explicit (all ones) attention_mask to the model instead of None.",
    )
    # optimization
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    # system
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="bfloat16 runs forward and loss under autocast; the weights stay in float32.",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    set_seed(args.seed)
    device = torch.device(args.device)

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"Model: {n_params / 1e6:.1f}M parameters, attention={model.config._attn_implementation}")

    # no weight decay on biases and norm weights
    no_decay = ["bias", "norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.lr)
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.steps,
    )

    use_amp = args.dtype == "bfloat16"
    tokens_per_step = args.batch_size * args.seq_len
    generator = torch.Generator().manual_seed(args.seed)

    logger.info("***** Running training *****")
    logger.info(f"  Batch size = {args.batch_size}, sequence length = {args.seq_len}")
    logger.info(f"  Total optimization steps = {args.steps}")
    logger.info(f"  Autocast dtype = {args.dtype if use_amp else None}, device = {device}")

    for step in range(args.steps):
        t0 = time.perf_counter()

        input_ids = torch.randint(
            0, config.vocab_size, (args.batch_size, args.seq_len), generator=generator
        ).to(device)
        batch = {"input_ids": input_ids, "labels": input_ids}
        if args.attention_mask:
            batch["attention_mask"] = torch.ones_like(input_ids)

        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            outputs = model(**batch)
            loss = outputs.loss

        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        loss_value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info(
            f"step {step}: loss {loss_value:.4f} | ppl {math.exp(min(loss_value, 20)):.1f} | "
            f"grad_norm {grad_norm.item():.3f} | lr {lr_scheduler.get_last_lr()[0]:.2e} | "
            f"{dt * 1000:.0f} ms | {tokens_per_step / dt:,.0f} tokens/s"
        )

    if device.type == "cuda":
        logger.info(f"Peak memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
