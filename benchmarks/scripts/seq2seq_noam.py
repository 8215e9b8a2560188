# Seq2seq nn.Transformer, "annotated transformer"/pytorch tutorial style, Noam LR, grad accum, fp16 AMP
import argparse, math, time
import torch
import torch.nn as nn
from torch import Tensor

p = argparse.ArgumentParser()
p.add_argument("--d_model", type=int, default=1024)
p.add_argument("--nhead", type=int, default=16)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--ffn", type=int, default=4096)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--src_len", type=int, default=256)
p.add_argument("--tgt_len", type=int, default=256)
p.add_argument("--accum", type=int, default=4)
p.add_argument("--updates", type=int, default=3)
p.add_argument("--warmup", type=int, default=4000)
p.add_argument("--device", default="cuda")
args = p.parse_args()
DEVICE = torch.device(args.device)
PAD_IDX, BOS_IDX, EOS_IDX = 1, 2, 3

class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 5000):
        super(PositionalEncoding, self).__init__()
        den = torch.exp(- torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('pos_embedding', pos_embedding)
    def forward(self, token_embedding: Tensor):
        return self.dropout(token_embedding + self.pos_embedding[:token_embedding.size(0), :])

class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size):
        super(TokenEmbedding, self).__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size
    def forward(self, tokens: Tensor):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)

class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, src_vocab_size, tgt_vocab_size,
                 dim_feedforward=512, dropout=0.1):
        super(Seq2SeqTransformer, self).__init__()
        self.transformer = nn.Transformer(d_model=emb_size, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                          num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                                          dropout=dropout)
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout)
    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(outs)

def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz), device=DEVICE)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
    return mask

def create_mask(src, tgt):
    src_seq_len = src.shape[0]
    tgt_seq_len = tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len), device=DEVICE).type(torch.bool)
    src_padding_mask = (src == PAD_IDX).transpose(0, 1)
    tgt_padding_mask = (tgt == PAD_IDX).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask

def fake_batch():
    # (seq, batch) like the torchtext tutorial, with padded tails
    src = torch.randint(4, args.vocab, (args.src_len, args.batch))
    tgt = torch.randint(4, args.vocab, (args.tgt_len + 1, args.batch))
    lens = torch.randint(args.src_len // 2, args.src_len, (args.batch,))
    for b in range(args.batch):
        src[lens[b]:, b] = PAD_IDX
        tgt[lens[b]:, b] = PAD_IDX
    return src, tgt

transformer = Seq2SeqTransformer(args.layers, args.layers, args.d_model, args.nhead, args.vocab, args.vocab, args.ffn)
for p_ in transformer.parameters():
    if p_.dim() > 1:
        nn.init.xavier_uniform_(p_)
transformer = transformer.to(DEVICE)
loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD_IDX, label_smoothing=0.1)
optimizer = torch.optim.Adam(transformer.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
noam = lambda step: args.d_model ** -0.5 * min((step + 1) ** -0.5, (step + 1) * args.warmup ** -1.5)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=noam)
scaler = torch.cuda.amp.GradScaler()

def train_epoch(model, optimizer):
    model.train()
    losses = 0
    optimizer.zero_grad(set_to_none=True)
    for i in range(args.updates * args.accum):
        src, tgt = fake_batch()
        src = src.to(DEVICE)
        tgt = tgt.to(DEVICE)
        tgt_input = tgt[:-1, :]
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
            tgt_out = tgt[1:, :]
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            loss = loss / args.accum
        scaler.scale(loss).backward()
        if (i + 1) % args.accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        losses += loss.item()
    return losses / (args.updates * args.accum)

for epoch in range(1, 2):
    start_time = time.time()
    train_loss = train_epoch(transformer, optimizer)
    print(f"Epoch: {epoch}, Train loss: {train_loss:.3f}, Epoch time = {(time.time() - start_time):.3f}s")
