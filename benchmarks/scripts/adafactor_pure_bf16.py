# T5-style encoder-decoder on torch.nn.Transformer, trained in "pure bf16" (the whole model cast with
# model.to(dtype=torch.bfloat16), no autocast, no fp32 master weights), with PyTorch's own
# torch.optim.Adafactor (factored row/col second moments) for the weight matrices and
# torch.optim.Adam(amsgrad=True) for the shared embedding, the norms and the biases: two optimizers,
# both stepped every iteration. Old habits kept on purpose: zero_grad(set_to_none=False) (gradients
# stay allocated between steps), clip_grad_norm_(foreach=True) over both groups, a float causal mask
# from nn.Transformer.generate_square_subsequent_mask(dtype=bf16) next to boolean key-padding masks,
# input embedding tied with the LM head by `self.lm_head.weight = self.embed.weight`.
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab_size=32000, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 dim_feedforward=2048, dropout=0.1, max_len=512, pad_id=0):
        super().__init__()
        self.d_model = d_model
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        # fixed sinusoidal positions, a buffer (cast to bf16 with the model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pos_emb", pe, persistent=False)
        self.transformer = nn.Transformer(
            d_model=d_model, nhead=nhead, num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward, dropout=dropout,
            activation="gelu", batch_first=True, norm_first=True)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tie input and output embeddings (T5 / Vaswani habit)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)

    def embed_tokens(self, ids):
        return self.dropout(self.embed(ids) * math.sqrt(self.d_model) + self.pos_emb[: ids.size(1)])

    def forward(self, src, tgt_in, tgt_mask, src_key_padding_mask, tgt_key_padding_mask):
        out = self.transformer(
            self.embed_tokens(src), self.embed_tokens(tgt_in),
            tgt_mask=tgt_mask,
            src_key_padding_mask=src_key_padding_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=src_key_padding_mask)
        return self.lm_head(out)


def get_args():
    p = argparse.ArgumentParser(description="pure-bf16 seq2seq with torch.optim.Adafactor + Adam(amsgrad)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--src-len", type=int, default=256)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--embed-lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def fake_batch(args, device, pad_id=0):
    # random token ids with random lengths, padded at the end (a collate_fn's output)
    B, S, T = args.batch_size, args.src_len, args.tgt_len
    src = torch.randint(1, args.vocab_size, (B, S), device=device)
    tgt = torch.randint(1, args.vocab_size, (B, T + 1), device=device)
    src_len = torch.randint(S // 2, S + 1, (B,), device=device)
    tgt_len = torch.randint(T // 2, T + 2, (B,), device=device)
    src_pad = torch.arange(S, device=device)[None, :] >= src_len[:, None]
    tgt_pad = torch.arange(T + 1, device=device)[None, :] >= tgt_len[:, None]
    src = src.masked_fill(src_pad, pad_id)
    tgt = tgt.masked_fill(tgt_pad, pad_id)
    return src, tgt


def main():
    args = get_args()
    device = args.device  # "cuda"
    torch.manual_seed(0)

    model = Seq2SeqTransformer(args.vocab_size, args.d_model, args.heads, args.layers, args.layers, args.d_ff)
    model.to(device=device, dtype=torch.bfloat16)  # pure bf16: weights, grads and optimizer state in bf16
    model.train()

    # weight matrices -> Adafactor; embedding (tied with lm_head), norms and biases -> Adam(amsgrad)
    matrices, others = [], []
    for name, p in model.named_parameters():
        if p.ndim >= 2 and not name.startswith("embed"):
            matrices.append(p)
        else:
            others.append(p)
    opt_factored = torch.optim.Adafactor(matrices, lr=args.lr, weight_decay=0.0)
    opt_adam = torch.optim.Adam(others, lr=args.embed_lr, betas=(0.9, 0.98), eps=1e-6, amsgrad=True)
    optimizers = [opt_factored, opt_adam]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters ({sum(p.numel() for p in matrices) / 1e6:.1f}M in Adafactor, "
          f"{sum(p.numel() for p in others) / 1e6:.1f}M in Adam)")

    T = args.tgt_len
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(T, device=device, dtype=torch.bfloat16)

    for step in range(args.steps):
        t0 = time.time()
        src, tgt = fake_batch(args, device, model.pad_id)
        tgt_in, labels = tgt[:, :-1], tgt[:, 1:]
        src_key_padding_mask = src == model.pad_id
        tgt_key_padding_mask = tgt_in == model.pad_id

        logits = model(src, tgt_in, tgt_mask, src_key_padding_mask, tgt_key_padding_mask)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=model.pad_id, label_smoothing=0.1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm, foreach=True)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=False)

        print(f"step {step}: loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
              f"{(time.time() - t0) * 1000:.0f} ms")

    if str(device).startswith("cuda"):
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
              f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
