# Custom HF transformers loop (no Trainer): Qwen2 from config, packed sequences with
# padding (labels=-100 on pad), gradient checkpointing (non-reentrant), plain AdamW
# (foreach=False), get_cosine_schedule_with_warmup, eval with inference_mode + generate.
import argparse

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--eval_every", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    return p.parse_args()


def make_packed_batch(batch_size, seq_len, vocab_size, eos_id, pad_id, gen):
    """Pack random 'documents' into rows; the tail of each row is padding."""
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
    for b in range(batch_size):
        pos = 0
        fill_to = seq_len - int(torch.randint(0, seq_len // 8, (1,), generator=gen))
        while pos < fill_to:
            doc_len = int(torch.randint(32, 256, (1,), generator=gen))
            doc_len = min(doc_len, fill_to - pos)
            input_ids[b, pos:pos + doc_len - 1] = torch.randint(3, vocab_size, (doc_len - 1,), generator=gen)
            input_ids[b, pos + doc_len - 1] = eos_id
            pos += doc_len
        attention_mask[b, :fill_to] = 1
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main():
    args = parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn,
                                             torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params "
          f"({model.config._attn_implementation}, {model.dtype})")

    no_decay = ["bias", "norm.weight", "layernorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, betas=(0.9, 0.95), foreach=False)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=args.max_steps)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (2, 16), generator=gen).to(device)

    model.train()
    for step in range(1, args.max_steps + 1):
        batch = make_packed_batch(args.batch_size, args.seq_len, config.vocab_size,
                                  config.eos_token_id, config.pad_token_id, gen)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        n_tok = int(batch["attention_mask"].sum())
        print(f"step {step}: loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
              f"lr {scheduler.get_last_lr()[0]:.2e} tokens {n_tok}")

        if step % args.eval_every == 0:
            model.eval()
            with torch.inference_mode():
                eval_batch = make_packed_batch(2, args.seq_len // 2, config.vocab_size,
                                               config.eos_token_id, config.pad_token_id, gen)
                eval_batch = {k: v.to(device) for k, v in eval_batch.items()}
                eval_loss = model(**eval_batch).loss
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=8, do_sample=False, use_cache=True,
                                     pad_token_id=config.pad_token_id)
            print(f"  eval loss {eval_loss.item():.4f}; generated {out[0, -8:].tolist()}")
            model.train()

    print(f"max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
