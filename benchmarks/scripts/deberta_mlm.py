"""Pretrain a small DeBERTa-v2 with masked language modelling on random token ids."""
import argparse
import math

import torch
from transformers import DebertaV2Config, DebertaV2ForMaskedLM, get_linear_schedule_with_warmup


def mask_tokens(input_ids, vocab_size, mask_id, mlm_prob=0.15):
    labels = input_ids.clone()
    prob = torch.full(labels.shape, mlm_prob, device=input_ids.device)
    masked = torch.bernoulli(prob).bool()
    labels[~masked] = -100
    replace = torch.bernoulli(torch.full(labels.shape, 0.8, device=input_ids.device)).bool() & masked
    input_ids = input_ids.clone()
    input_ids[replace] = mask_id
    rand = torch.bernoulli(torch.full(labels.shape, 0.5, device=input_ids.device)).bool() & masked & ~replace
    input_ids[rand] = torch.randint(vocab_size, labels.shape, device=input_ids.device)[rand]
    return input_ids, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    device = "cuda"
    config = DebertaV2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=256,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
        max_relative_positions=-1,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
    )
    model = DebertaV2ForMaskedLM._from_config(config)
    model.to(device)
    model.train()
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")

    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=5, num_training_steps=args.max_steps)
    mask_id = 4

    for step in range(args.max_steps):
        ids = torch.randint(5, args.vocab_size, (args.batch_size, args.seq_len), device=device)
        attention_mask = torch.ones_like(ids)
        inputs, labels = mask_tokens(ids, args.vocab_size, mask_id)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(input_ids=inputs, attention_mask=attention_mask, labels=labels)
        loss = outputs.loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} ppl {math.exp(min(loss.item(), 20)):.1f} "
                  f"gnorm {grad_norm.item():.2f} lr {scheduler.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
