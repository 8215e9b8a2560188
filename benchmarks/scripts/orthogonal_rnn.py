"""Character-level RNN LM with an orthogonal recurrent weight and a custom Symmetric parametrization, as in the PyTorch parametrizations tutorial, trained with truncated BPTT under parametrize.cached()."""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils.parametrizations import orthogonal


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


class OrthoRNNLM(nn.Module):
    def __init__(self, vocab, emb, hidden, cell="rnn"):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        if cell == "gru":
            self.cell = nn.GRUCell(emb, hidden)
        else:
            self.cell = nn.RNNCell(emb, hidden, nonlinearity="tanh")
        # recurrent weight kept orthogonal (exploding/vanishing gradients)
        if cell == "gru":
            # GRUCell stacks three gates in weight_hh: constrain the mixing layer instead
            self.mix = nn.Linear(hidden, hidden, bias=False)
            orthogonal(self.mix, "weight")
        else:
            orthogonal(self.cell, "weight_hh")
            self.mix = nn.Linear(hidden, hidden, bias=False)
        # a symmetric read-out mixing, as in the tutorial's Symmetric example
        self.sym = nn.Linear(hidden, hidden)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens, hidden):
        # tokens: (T, B)
        emb = self.embed(tokens)
        outputs = []
        for t in range(tokens.size(0)):
            hidden = self.cell(emb[t], hidden)
            outputs.append(torch.tanh(self.sym(self.mix(hidden))))
        out = torch.stack(outputs)
        return self.decoder(out), hidden


def main():
    parser = argparse.ArgumentParser(description="Orthogonal RNN language model (truncated BPTT)")
    parser.add_argument("--cell", choices=["rnn", "gru"], default="rnn")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--emsize", type=int, default=512)
    parser.add_argument("--nhid", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--bptt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="number of BPTT chunks (optimizer steps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1111)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda"

    # synthetic corpus, batchified as in the word_language_model example
    n_tokens = args.batch_size * (args.bptt * args.steps + 1)
    data = torch.randint(0, args.vocab, (n_tokens,), device=device)
    data = data.view(args.batch_size, -1).t().contiguous()  # (L, B)

    model = OrthoRNNLM(args.vocab, args.emsize, args.nhid, args.cell).to(device)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr, alpha=0.99, momentum=0.9)
    print(model)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    model.train()
    hidden = torch.zeros(args.batch_size, args.nhid, device=device)
    total_loss = 0.0
    start = time.time()
    for step, i in enumerate(range(0, data.size(0) - 1, args.bptt)):
        if step >= args.steps:
            break
        seq_len = min(args.bptt, data.size(0) - 1 - i)
        inputs = data[i:i + seq_len]
        targets = data[i + 1:i + 1 + seq_len].reshape(-1)
        # truncated BPTT: start from the previous chunk's state, without its history
        hidden = hidden.detach()
        optimizer.zero_grad()
        with parametrize.cached():
            output, hidden = model(inputs, hidden)
            loss = F.cross_entropy(output.view(-1, args.vocab), targets)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), args.clip)
        optimizer.step()

        total_loss += loss.item()
        if (step + 1) % args.log_interval == 0:
            cur = total_loss / args.log_interval
            elapsed = time.time() - start
            print(f"| step {step + 1:3d} | ms/batch {elapsed * 1000 / args.log_interval:6.1f} | "
                  f"loss {cur:5.2f} | ppl {math.exp(min(cur, 20)):8.2f}")
            total_loss = 0.0
            start = time.time()

    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
