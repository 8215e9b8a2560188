"""Word-level LSTM language model with an adaptive softmax (Grave et al., 2017).

In the spirit of pytorch/examples word_language_model, on a synthetic Zipf-distributed corpus.
"""
import argparse
import math
import time

import torch
import torch.nn as nn


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, cutoffs, dropout=0.3):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.proj = nn.Linear(nhid, ninp)  # project back so the softmax sees the embedding size
        self.crit = nn.AdaptiveLogSoftmaxWithLoss(ninp, ntoken, cutoffs=cutoffs, div_value=4.0)
        self.nlayers, self.nhid = nlayers, nhid
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, input, target, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(self.proj(output))
        out = self.crit(output.view(-1, output.size(2)), target.view(-1))
        return out.loss, hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz, device):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


def main():
    parser = argparse.ArgumentParser(description="Adaptive-softmax LSTM LM")
    parser.add_argument("--vocab", type=int, default=100000)
    parser.add_argument("--emsize", type=int, default=512)
    parser.add_argument("--nhid", type=int, default=1024)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--bptt", type=int, default=70)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200000)
    parser.add_argument("--log-interval", type=int, default=1)
    args = parser.parse_args()

    device = "cuda"
    torch.manual_seed(1111)
    ranks = torch.arange(1, args.vocab + 1, dtype=torch.float)
    corpus = torch.multinomial(1.0 / ranks, args.tokens, replacement=True)
    train_data = batchify(corpus, args.batch_size, device)

    cutoffs = [2000, 10000, 40000]
    model = RNNModel(args.vocab, args.emsize, args.nhid, args.nlayers, cutoffs).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    model.train()
    hidden = model.init_hidden(args.batch_size)
    start = time.time()
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        seq_len = min(args.bptt, train_data.size(0) - 1 - i)
        data, targets = train_data[i:i + seq_len], train_data[i + 1:i + 1 + seq_len]
        hidden = repackage_hidden(hidden)
        optimizer.zero_grad()
        loss, hidden = model(data, targets, hidden)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        cur_loss = loss.item()
        if batch % args.log_interval == 0:
            print(f"| batch {batch:5d} | ms/batch {(time.time() - start) * 1000:6.1f} | "
                  f"loss {cur_loss:5.2f} | ppl {math.exp(min(cur_loss, 20)):9.2f}")
            start = time.time()


if __name__ == "__main__":
    main()
