# Word-level LSTM language model, in the style of pytorch/examples/word_language_model,
# plus a packed-sequence GRU classifier trained in a second loop.
import math
import time
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(1111)
device = torch.device("cuda")

ntokens = 33278          # WikiText-2 vocab size
emsize, nhid, nlayers = 650, 650, 2
bptt, batch_size, lr, clip = 35, 20, 20.0, 0.25


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=True):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


# fake corpus instead of reading wiki.train.tokens
corpus_ids = torch.randint(0, ntokens, (batch_size * bptt * 8 + 1,))
train_data = batchify(corpus_ids, batch_size)

model = RNNModel("LSTM", ntokens, emsize, nhid, nlayers, dropout=0.5).to(device)
criterion = nn.NLLLoss()

model.train()
total_loss = 0.
start_time = time.time()
hidden = model.init_hidden(batch_size)
for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
    data, targets = get_batch(train_data, i)
    hidden = repackage_hidden(hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    total_loss += loss.item()
    print(f"| batch {batch:3d} | lr {lr:.2f} | loss {loss.item():5.2f} | ppl {math.exp(min(loss.item(), 20)):8.2f}")


# ---- second model: GRU classifier over variable-length sequences with packing ----
class PackedGRUClassifier(nn.Module):
    def __init__(self, vocab, emb, hid, ncls):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb, padding_idx=0)
        self.gru = nn.GRU(emb, hid, num_layers=2, batch_first=True, bidirectional=True, dropout=0.2)
        self.fc = nn.Linear(2 * hid, ncls)

    def forward(self, x, lengths):
        e = self.emb(x)
        packed = nn.utils.rnn.pack_padded_sequence(e, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, h = self.gru(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        h = torch.cat([h[-2], h[-1]], dim=1)
        return self.fc(h)


clf = PackedGRUClassifier(20000, 300, 256, 5).to(device)
opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
for step in range(6):
    B, T = 64, 120
    lengths = torch.randint(10, T + 1, (B,), device=device)
    x = torch.randint(1, 20000, (B, T), device=device)
    pad_mask = torch.arange(T, device=device)[None, :] >= lengths[:, None]
    x = x.masked_fill(pad_mask, 0)
    y = torch.randint(0, 5, (B,), device=device)
    opt.zero_grad(set_to_none=True)
    logits = clf(x, lengths)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    nn.utils.clip_grad_norm_(clf.parameters(), 1.0)
    opt.step()
    print(f"gru step {step} loss {loss.item():.4f}")
