# Custom LSTM language model in the older TorchScript style of pytorch's
# benchmarks/fastrnns/custom_lstms.py: the cell, the layer (a time loop) and the stack
# are torch.jit.ScriptModules with @torch.jit.script_method forwards, the body holding
# them goes through torch.jit.script(model) and makes its initial state inside scripted
# code (torch.zeros(..., device=x.device)). The output head is an MLP rewritten with
# torch.fx (torch.relu -> F.gelu) and recompiled. Trained with SGD + clip_grad_norm_.
import argparse
import math
import time
from typing import List, Tuple

import torch
import torch.fx
import torch.jit as jit
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter


class LSTMCell(jit.ScriptModule):
    def __init__(self, input_size, hidden_size):
        super(LSTMCell, self).__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_ih = Parameter(torch.randn(4 * hidden_size, input_size))
        self.weight_hh = Parameter(torch.randn(4 * hidden_size, hidden_size))
        self.bias_ih = Parameter(torch.randn(4 * hidden_size))
        self.bias_hh = Parameter(torch.randn(4 * hidden_size))

    @jit.script_method
    def forward(self, input: Tensor, state: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        hx, cx = state
        gates = (torch.mm(input, self.weight_ih.t()) + self.bias_ih +
                 torch.mm(hx, self.weight_hh.t()) + self.bias_hh)
        ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)

        ingate = torch.sigmoid(ingate)
        forgetgate = torch.sigmoid(forgetgate)
        cellgate = torch.tanh(cellgate)
        outgate = torch.sigmoid(outgate)

        cy = (forgetgate * cx) + (ingate * cellgate)
        hy = outgate * torch.tanh(cy)

        return hy, (hy, cy)


class LSTMLayer(jit.ScriptModule):
    def __init__(self, cell, *cell_args):
        super(LSTMLayer, self).__init__()
        self.cell = cell(*cell_args)

    @jit.script_method
    def forward(self, input: Tensor, state: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        inputs = input.unbind(0)
        outputs = torch.jit.annotate(List[Tensor], [])
        for i in range(len(inputs)):
            out, state = self.cell(inputs[i], state)
            outputs += [out]
        return torch.stack(outputs), state


def init_stacked_lstm(num_layers, layer, first_layer_args, other_layer_args):
    layers = [layer(*first_layer_args)] + [layer(*other_layer_args)
                                           for _ in range(num_layers - 1)]
    return nn.ModuleList(layers)


class StackedLSTMWithDropout(jit.ScriptModule):
    # Necessary for iterating through self.layers and dropout support
    __constants__ = ['layers', 'num_layers']

    def __init__(self, num_layers, layer, first_layer_args, other_layer_args):
        super(StackedLSTMWithDropout, self).__init__()
        self.layers = init_stacked_lstm(num_layers, layer, first_layer_args, other_layer_args)
        self.num_layers = num_layers
        self.dropout_layer = nn.Dropout(0.4)

    @jit.script_method
    def forward(self, input: Tensor, states: List[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
        output_states = jit.annotate(List[Tuple[Tensor, Tensor]], [])
        output = input
        i = 0
        for rnn_layer in self.layers:
            state = states[i]
            output, out_state = rnn_layer(output, state)
            # Apply the dropout layer except the last layer
            if i < self.num_layers - 1:
                output = self.dropout_layer(output)
            output_states += [out_state]
            i += 1
        return output, output_states


class RNNBody(nn.Module):
    """Embedding + stacked custom LSTM; scripted as a whole with torch.jit.script."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.2):
        super().__init__()
        self.nhid = nhid
        self.nlayers = nlayers
        self.encoder = nn.Embedding(ntoken, ninp)
        self.drop = nn.Dropout(dropout)
        self.rnn = StackedLSTMWithDropout(nlayers, LSTMLayer,
                                          first_layer_args=[LSTMCell, ninp, nhid],
                                          other_layer_args=[LSTMCell, nhid, nhid])

    def forward(self, tokens: Tensor) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
        emb = self.drop(self.encoder(tokens))
        bsz = tokens.size(1)
        states: List[Tuple[Tensor, Tensor]] = []
        for _ in range(self.nlayers):
            states.append((torch.zeros(bsz, self.nhid, device=emb.device, dtype=emb.dtype),
                           torch.zeros(bsz, self.nhid, device=emb.device, dtype=emb.dtype)))
        output, new_states = self.rnn(emb, states)
        return self.drop(output), new_states


class MLPHead(nn.Module):
    def __init__(self, nhid: int, hidden: int, ntoken: int):
        super().__init__()
        self.fc1 = nn.Linear(nhid, hidden)
        self.fc2 = nn.Linear(hidden, ntoken)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        return self.fc2(x)


def relu_to_gelu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.relu:
            node.target = F.gelu
    gm.graph.lint()
    gm.recompile()
    return gm


class LanguageModel(nn.Module):
    def __init__(self, body, head):
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, tokens):
        output, _ = self.body(tokens)
        return self.head(output)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    torch.manual_seed(1111)
    device = args.device

    ntokens, emsize, nhid, nlayers = 10000, 512, 512, 2
    body = torch.jit.script(RNNBody(ntokens, emsize, nhid, nlayers))
    head = relu_to_gelu(torch.fx.symbolic_trace(MLPHead(nhid, 1024, ntokens)))
    print(head.code)
    model = LanguageModel(body, head).to(device)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    model.train()
    start = time.time()
    for step in range(args.steps):
        data = torch.randint(0, ntokens, (args.bptt, args.batch_size), device=device)
        targets = torch.randint(0, ntokens, (args.bptt * args.batch_size,), device=device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        print(f"step {step + 1}: loss {loss.item():.3f} ppl {math.exp(min(loss.item(), 20)):.1f} "
              f"grad norm {grad_norm.item():.2f} ({time.time() - start:.1f}s)")
    print("done")


if __name__ == "__main__":
    main()
