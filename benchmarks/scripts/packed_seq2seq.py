# Seq2seq with attention, PyTorch chatbot-tutorial / OpenNMT-py habits: variable-length sources
# sorted by length in a host collate_fn, pack_padded_sequence into a 2-layer bidirectional GRU,
# pad_packed_sequence, a Luong ("general") attention decoder stepped token by token in a Python
# loop with teacher forcing chosen by random.random(), greedy topk(1) otherwise, masked NLL loss,
# clip_grad_norm_, one Adam over an NMTModel-like container whose parts the loop calls itself.
import argparse
import itertools
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--max_src", type=int, default=100)
p.add_argument("--max_tgt", type=int, default=100)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--clip", type=float, default=50.0)
p.add_argument("--teacher_forcing_ratio", type=float, default=0.5)
p.add_argument("--device", default="cuda")
args = p.parse_args()

device = torch.device(args.device)
random.seed(0)
torch.manual_seed(0)

PAD_token, SOS_token, EOS_token = 0, 1, 2


# ---------------------------------------------------------------- data (host side)
class RandomPairs(Dataset):
    """Stand-in for a tokenised parallel corpus: lists of token ids of random lengths."""

    def __init__(self, n, vocab, max_src, max_tgt):
        self.pairs = []
        for _ in range(n):
            ls = random.randint(3, max_src)
            lt = random.randint(3, max_tgt)
            src = [random.randrange(3, vocab) for _ in range(ls - 1)] + [EOS_token]
            tgt = [random.randrange(3, vocab) for _ in range(lt - 1)] + [EOS_token]
            self.pairs.append((src, tgt))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def zero_padding(seqs, fillvalue=PAD_token):
    return list(itertools.zip_longest(*seqs, fillvalue=fillvalue))


def binary_matrix(padded):
    return [[tok != PAD_token for tok in row] for row in padded]


def batch2train_data(pair_batch):
    # the tutorial's batch2TrainData: sort by source length, longest first
    pair_batch.sort(key=lambda x: len(x[0]), reverse=True)
    src_batch, tgt_batch = zip(*pair_batch)
    lengths = torch.tensor([len(s) for s in src_batch])
    src = torch.LongTensor(zero_padding(src_batch)).t().contiguous()     # (B, S) batch first
    padded_tgt = zero_padding(tgt_batch)                                  # (T, B)
    max_target_len = max(len(t) for t in tgt_batch)
    mask = torch.BoolTensor(binary_matrix(padded_tgt))
    tgt = torch.LongTensor(padded_tgt)
    return src, lengths, tgt, mask, max_target_len


# ---------------------------------------------------------------- model
class EncoderRNN(nn.Module):
    def __init__(self, hidden_size, embedding, n_layers=2, dropout=0.1):
        super().__init__()
        self.n_layers = n_layers
        self.hidden_size = hidden_size
        self.embedding = embedding
        self.gru = nn.GRU(hidden_size, hidden_size, n_layers, dropout=(0 if n_layers == 1 else dropout),
                          bidirectional=True, batch_first=True)

    def forward(self, src, lengths, hidden=None):
        embedded = self.embedding(src)
        packed = nn.utils.rnn.pack_padded_sequence(embedded, lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        outputs, hidden = self.gru(packed, hidden)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True)
        # sum the two directions
        outputs = outputs[:, :, :self.hidden_size] + outputs[:, :, self.hidden_size:]
        return outputs, hidden


class Attn(nn.Module):
    # Luong attention layer
    def __init__(self, method, hidden_size):
        super().__init__()
        self.method = method
        if self.method not in ["dot", "general", "concat"]:
            raise ValueError(self.method, "is not an appropriate attention method.")
        self.hidden_size = hidden_size
        if self.method == "general":
            self.attn = nn.Linear(self.hidden_size, hidden_size)
        elif self.method == "concat":
            self.attn = nn.Linear(self.hidden_size * 2, hidden_size)
            self.v = nn.Parameter(torch.FloatTensor(hidden_size))

    def dot_score(self, hidden, encoder_output):
        return torch.sum(hidden * encoder_output, dim=2)

    def general_score(self, hidden, encoder_output):
        energy = self.attn(encoder_output)
        return torch.sum(hidden * energy, dim=2)

    def concat_score(self, hidden, encoder_output):
        energy = self.attn(torch.cat((hidden.expand(-1, encoder_output.size(1), -1), encoder_output), 2)).tanh()
        return torch.sum(self.v * energy, dim=2)

    def forward(self, hidden, encoder_outputs, src_mask):
        # hidden: (B, 1, H), encoder_outputs: (B, S, H)
        if self.method == "general":
            attn_energies = self.general_score(hidden, encoder_outputs)
        elif self.method == "concat":
            attn_energies = self.concat_score(hidden, encoder_outputs)
        else:
            attn_energies = self.dot_score(hidden, encoder_outputs)
        attn_energies = attn_energies.masked_fill(~src_mask, float("-inf"))
        return F.softmax(attn_energies, dim=1).unsqueeze(1)               # (B, 1, S)


class LuongAttnDecoderRNN(nn.Module):
    def __init__(self, attn_model, embedding, hidden_size, output_size, n_layers=2, dropout=0.1):
        super().__init__()
        self.attn_model = attn_model
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.n_layers = n_layers
        self.embedding = embedding
        self.embedding_dropout = nn.Dropout(dropout)
        self.gru = nn.GRU(hidden_size, hidden_size, n_layers, dropout=(0 if n_layers == 1 else dropout),
                          batch_first=True)
        self.concat = nn.Linear(hidden_size * 2, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)
        self.attn = Attn(attn_model, hidden_size)

    def forward(self, input_step, last_hidden, encoder_outputs, src_mask):
        # one time step at a time; input_step: (B, 1)
        embedded = self.embedding_dropout(self.embedding(input_step))
        rnn_output, hidden = self.gru(embedded, last_hidden)                # (B, 1, H)
        attn_weights = self.attn(rnn_output, encoder_outputs, src_mask)     # (B, 1, S)
        context = attn_weights.bmm(encoder_outputs)                          # (B, 1, H)
        concat_input = torch.cat((rnn_output.squeeze(1), context.squeeze(1)), 1)
        concat_output = torch.tanh(self.concat(concat_input))
        output = F.softmax(self.out(concat_output), dim=1)
        return output, hidden


class NMTModel(nn.Module):
    """OpenNMT-py's container: the loop calls its encoder and decoder itself."""

    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.src_embedding = nn.Embedding(vocab, hidden, padding_idx=PAD_token)
        self.tgt_embedding = nn.Embedding(vocab, hidden, padding_idx=PAD_token)
        self.encoder = EncoderRNN(hidden, self.src_embedding, layers)
        self.decoder = LuongAttnDecoderRNN("general", self.tgt_embedding, hidden, vocab, layers)


def maskNLLLoss(inp, target, mask):
    nTotal = mask.sum()
    crossEntropy = -torch.log(torch.gather(inp, 1, target.view(-1, 1)).squeeze(1))
    loss = crossEntropy.masked_select(mask).mean()
    loss = loss.to(device)
    return loss, nTotal.item()


def train(src, lengths, tgt, mask, max_target_len, model, optimizer, batch_size, clip):
    optimizer.zero_grad()
    src = src.to(device)
    tgt = tgt.to(device)
    mask = mask.to(device)
    lengths = lengths.to(device)     # OpenNMT keeps lengths on the device, packing wants them on the host
    src_mask = torch.arange(src.size(1), device=device)[None, :] < lengths[:, None]

    loss = 0
    print_losses = []
    n_totals = 0

    encoder_outputs, encoder_hidden = model.encoder(src, lengths)
    decoder_input = torch.LongTensor([[SOS_token] for _ in range(batch_size)]).to(device)   # (B, 1)
    # the forward directions' final states of both layers start the decoder
    decoder_hidden = encoder_hidden[:model.decoder.n_layers]

    use_teacher_forcing = True if random.random() < args.teacher_forcing_ratio else False
    if use_teacher_forcing:
        for t in range(max_target_len):
            decoder_output, decoder_hidden = model.decoder(decoder_input, decoder_hidden, encoder_outputs, src_mask)
            decoder_input = tgt[t].view(-1, 1)
            mask_loss, nTotal = maskNLLLoss(decoder_output, tgt[t], mask[t])
            loss += mask_loss
            print_losses.append(mask_loss.item() * nTotal)
            n_totals += nTotal
    else:
        for t in range(max_target_len):
            decoder_output, decoder_hidden = model.decoder(decoder_input, decoder_hidden, encoder_outputs, src_mask)
            _, topi = decoder_output.topk(1)
            decoder_input = torch.LongTensor([[topi[i][0]] for i in range(batch_size)])
            decoder_input = decoder_input.to(device)
            mask_loss, nTotal = maskNLLLoss(decoder_output, tgt[t], mask[t])
            loss += mask_loss
            print_losses.append(mask_loss.item() * nTotal)
            n_totals += nTotal

    loss.backward()
    _ = nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return sum(print_losses) / n_totals, use_teacher_forcing


model = NMTModel(args.vocab, args.hidden, args.layers).to(device)
model.train()
n_params = sum(p.numel() for p in model.parameters())
print(f"parameters: {n_params / 1e6:.1f}M")
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

dataset = RandomPairs(args.batch * args.steps, args.vocab, args.max_src, args.max_tgt)
loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, collate_fn=batch2train_data, drop_last=True)

for step, (src, lengths, tgt, mask, max_target_len) in enumerate(loader):
    t0 = time.time()
    loss, tf = train(src, lengths, tgt, mask, max_target_len, model, optimizer, args.batch, args.clip)
    print(f"step {step} src {tuple(src.shape)} tgt_len {max_target_len} teacher_forcing={tf} "
          f"loss {loss:.4f} {time.time() - t0:.2f}s")
