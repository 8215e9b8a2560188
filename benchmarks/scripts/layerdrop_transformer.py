"""RoBERTa-base-like masked-LM encoder (fairseq TransformerEncoder style: T x B x C, post-LN, learned positions from make_positions) trained with LayerDrop: in every forward each layer draws dropout_probability = torch.empty(1).uniform_() on the host and is skipped when it is below encoder_layerdrop; BERT-style 15 % masking in the collator with labels = -100 elsewhere and a full-vocabulary cross-entropy (ignore_index=-100); AdamW with no decay on biases/LayerNorm, a linear warmup/decay LambdaLR; fp32 with TF32 matmuls via torch.set_float32_matmul_precision("high")."""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR


# ----------------------------------------------------------------------------- fairseq/utils.py
def make_positions(tensor, padding_idx: int):
    """Replace non-padding symbols with their position numbers.

    Position numbers begin at padding_idx+1. Padding symbols are ignored.
    """
    # The series of casts and type-conversions here are carefully
    # balanced to both work with ONNX export and XLA.
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.max_positions = self.num_embeddings - self.padding_idx - 1

    def forward(self, input):
        positions = make_positions(input, self.padding_idx)
        return F.embedding(positions, self.weight, self.padding_idx)


# ----------------------------------------------------------------------------- fairseq/modules/multihead_attention.py
class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        # Empirically observed the convergence to be much better with the scaled initialization
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        # T x B x C -> B x H x T x D
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        q = q.view(bsz, self.num_heads, tgt_len, self.head_dim)
        k = k.view(bsz, self.num_heads, -1, self.head_dim)
        v = v.view(bsz, self.num_heads, -1, self.head_dim)
        attn_mask = None
        if key_padding_mask is not None:
            attn_mask = ~key_padding_mask[:, None, None, :]  # True = attend
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=self.dropout if self.training else 0.0)
        attn = attn.transpose(1, 2).reshape(bsz, tgt_len, embed_dim).transpose(0, 1).contiguous()
        return self.out_proj(attn)


# ----------------------------------------------------------------------------- fairseq/modules/transformer_layer.py
class TransformerEncoderLayer(nn.Module):
    """Encoder layer block (post-LN, as in the original paper and RoBERTa)."""

    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.encoder_embed_dim
        self.self_attn = MultiheadAttention(self.embed_dim, args.encoder_attention_heads,
                                            dropout=args.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.dropout = args.dropout
        self.activation_dropout = args.activation_dropout
        self.normalize_before = args.encoder_normalize_before
        self.fc1 = nn.Linear(self.embed_dim, args.encoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, x, encoder_padding_mask):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = self.self_attn(x, key_padding_mask=encoder_padding_mask)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = F.gelu(self.fc1(x))
        x = F.dropout(x, p=float(self.activation_dropout), training=self.training)
        x = self.fc2(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


# ----------------------------------------------------------------------------- fairseq/models/transformer.py
class TransformerEncoder(nn.Module):
    def __init__(self, args, embed_tokens):
        super().__init__()
        self.dropout = args.dropout
        self.encoder_layerdrop = args.encoder_layerdrop
        embed_dim = embed_tokens.embedding_dim
        self.padding_idx = embed_tokens.padding_idx
        self.embed_tokens = embed_tokens
        self.embed_positions = LearnedPositionalEmbedding(args.max_positions + self.padding_idx + 1, embed_dim,
                                                          self.padding_idx)
        self.layernorm_embedding = nn.LayerNorm(embed_dim)
        self.layers = nn.ModuleList([TransformerEncoderLayer(args) for _ in range(args.encoder_layers)])

    def forward(self, src_tokens):
        # compute padding mask
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        if not encoder_padding_mask.any():
            encoder_padding_mask = None

        x = self.embed_tokens(src_tokens)
        x = x + self.embed_positions(src_tokens)
        x = self.layernorm_embedding(x)
        x = F.dropout(x, p=self.dropout, training=self.training)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        # encoder layers
        for layer in self.layers:
            # add LayerDrop (see https://arxiv.org/abs/1909.11556 for description)
            dropout_probability = torch.empty(1).uniform_()
            if not self.training or (dropout_probability > self.encoder_layerdrop):
                x = layer(x, encoder_padding_mask)

        # T x B x C -> B x T x C
        return x.transpose(0, 1)


class RobertaLMHead(nn.Module):
    """Head for masked language modeling."""

    def __init__(self, embed_dim, output_dim, weight):
        super().__init__()
        self.dense = nn.Linear(embed_dim, embed_dim)
        self.layer_norm = nn.LayerNorm(embed_dim)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(output_dim))

    def forward(self, features):
        x = self.dense(features)
        x = F.gelu(x)
        x = self.layer_norm(x)
        # project back to size of vocabulary with bias
        return F.linear(x, self.weight) + self.bias


def init_bert_params(module):
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    if isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()


class RobertaModel(nn.Module):
    def __init__(self, args, vocab_size, padding_idx):
        super().__init__()
        embed_tokens = nn.Embedding(vocab_size, args.encoder_embed_dim, padding_idx)
        self.encoder = TransformerEncoder(args, embed_tokens)
        self.lm_head = RobertaLMHead(args.encoder_embed_dim, vocab_size, embed_tokens.weight)
        self.apply(init_bert_params)

    def forward(self, src_tokens):
        return self.lm_head(self.encoder(src_tokens))


# ----------------------------------------------------------------------------- data (synthetic token blocks)
BOS, PAD, EOS, MASK = 0, 1, 2, 50264


def synthetic_batch(batch_size, max_len, vocab_size, generator):
    """Sentences of random length, <s> ... </s>, right-padded with <pad>."""
    tokens = torch.full((batch_size, max_len), PAD, dtype=torch.long)
    lengths = torch.randint(max_len // 2, max_len + 1, (batch_size,), generator=generator)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0] = BOS
        tokens[i, 1:n - 1] = torch.randint(4, vocab_size - 1, (n - 2,), generator=generator)
        tokens[i, n - 1] = EOS
    return tokens


def mask_tokens(inputs, vocab_size, mlm_probability=0.15, generator=None):
    """Prepare masked tokens inputs/labels for masked language modeling: 80% MASK, 10% random, 10% original."""
    labels = inputs.clone()
    probability_matrix = torch.full(labels.shape, mlm_probability)
    special_tokens_mask = (inputs == BOS) | (inputs == EOS) | (inputs == PAD)
    probability_matrix.masked_fill_(special_tokens_mask, value=0.0)
    masked_indices = torch.bernoulli(probability_matrix, generator=generator).bool()
    labels[~masked_indices] = -100  # We only compute loss on masked tokens

    indices_replaced = torch.bernoulli(torch.full(labels.shape, 0.8), generator=generator).bool() & masked_indices
    inputs[indices_replaced] = MASK

    indices_random = (torch.bernoulli(torch.full(labels.shape, 0.5), generator=generator).bool()
                      & masked_indices & ~indices_replaced)
    random_words = torch.randint(vocab_size, labels.shape, dtype=torch.long, generator=generator)
    inputs[indices_random] = random_words[indices_random]
    return inputs, labels


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def get_args():
    parser = argparse.ArgumentParser(description="masked LM pretraining with LayerDrop")
    parser.add_argument("--encoder-layers", type=int, default=12)
    parser.add_argument("--encoder-embed-dim", type=int, default=768)
    parser.add_argument("--encoder-ffn-embed-dim", type=int, default=3072)
    parser.add_argument("--encoder-attention-heads", type=int, default=12)
    parser.add_argument("--encoder-normalize-before", action="store_true")
    parser.add_argument("--encoder-layerdrop", type=float, default=0.2, help="LayerDrop probability for encoder")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--activation-dropout", type=float, default=0.0)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=50265)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens-per-sample", type=int, default=512)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-updates", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda")

    model = RobertaModel(args, args.vocab_size, padding_idx=PAD).to(device)
    print(f"num. model params: {sum(p.numel() for p in model.parameters()):,}, "
          f"encoder_layerdrop={args.encoder_layerdrop}")

    no_decay = ["bias", "layer_norm.weight", "layernorm_embedding.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_updates, args.steps)

    g = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.time()
    for num_updates in range(1, args.steps + 1):
        src_tokens = synthetic_batch(args.batch_size, args.tokens_per_sample, args.vocab_size, g)
        src_tokens, labels = mask_tokens(src_tokens, args.vocab_size, generator=g)
        src_tokens = src_tokens.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)

        logits = model(src_tokens)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()

        if num_updates % args.log_interval == 0 or num_updates == 1:
            ntokens = (labels != -100).sum().item()
            elapsed = time.time() - t0
            print(f"| num_updates {num_updates:5d} | loss {loss.item() / math.log(2):.3f} (bits) | "
                  f"masked tokens {ntokens} | lr {scheduler.get_last_lr()[0]:.3e} | "
                  f"wall {elapsed:.1f}s | max mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
