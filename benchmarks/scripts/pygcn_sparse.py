# tkipf/pygcn habit (and Diego999/pyGAT's, with --model gat): full-batch node classification on a
# synthetic Cora-sized citation graph (2708 nodes, 1433 row-normalised bag-of-words features as a
# dense float tensor, ~5.3k undirected edges, 7 classes, index tensors for the train/val/test
# splits). The adjacency is built on the host the legacy way (symmetrised, self-loops, row
# normalised, then torch.sparse.FloatTensor(indices, values, shape)) and moved with .cuda(); GCN
# layers are support = torch.mm(input, W); output = torch.spmm(adj, support). The GAT uses a dense
# adjacency and the original pyGAT layer: a_input of N x N x 2F by repeat/cat, e = leakyrelu(
# matmul(a_input, a).squeeze(2)), torch.where(adj > 0, e, -9e15) and a softmax over N x N, 8 heads.
# Adam with weight_decay 5e-4, dropout, F.nll_loss on output[idx_train], accuracy each epoch with
# .max(1)[1].type_as(labels).eq(labels).double().sum(), a validation forward in eval mode (without
# no_grad, as pygcn does unless --fastmode), and loss.item() printed.
import argparse
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.module import Module
from torch.nn.parameter import Parameter

parser = argparse.ArgumentParser()
parser.add_argument("--no-cuda", action="store_true", default=False, help="Disables CUDA training.")
parser.add_argument("--fastmode", action="store_true", default=False, help="Validate during training pass.")
parser.add_argument("--model", choices=["gcn", "gat"], default="gcn")
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--steps", type=int, default=10, help="Number of epochs to train.")
parser.add_argument("--lr", type=float, default=None)
parser.add_argument("--weight_decay", type=float, default=5e-4)
parser.add_argument("--hidden", type=int, default=None)
parser.add_argument("--nb_heads", type=int, default=8)
parser.add_argument("--dropout", type=float, default=None)
parser.add_argument("--alpha", type=float, default=0.2, help="Alpha for the leaky_relu.")
parser.add_argument("--nodes", type=int, default=2708)
parser.add_argument("--features", type=int, default=1433)
parser.add_argument("--edges", type=int, default=5278, help="undirected edges")
parser.add_argument("--classes", type=int, default=7)
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()
gat = args.model == "gat"
args.lr = args.lr if args.lr is not None else (0.005 if gat else 0.01)
args.hidden = args.hidden if args.hidden is not None else (8 if gat else 16)
args.dropout = args.dropout if args.dropout is not None else (0.6 if gat else 0.5)

np.random.seed(args.seed)
torch.manual_seed(args.seed)
if args.cuda:
    torch.cuda.manual_seed(args.seed)


# ---------------------------------------------------------------- utils.py
def encode_onehot(labels):
    classes = set(labels)
    classes_dict = {c: np.identity(len(classes))[i, :] for i, c in enumerate(classes)}
    return np.array(list(map(classes_dict.get, labels)), dtype=np.int32)


def normalize(mx):
    """Row-normalize a dense numpy matrix (pygcn does it on a scipy.sparse one)."""
    rowsum = np.array(mx.sum(1))
    r_inv = np.power(rowsum, -1.0).flatten()
    r_inv[np.isinf(r_inv)] = 0.0
    return mx * r_inv[:, None]


def normalize_coo(rows, cols, vals, n):
    rowsum = np.bincount(rows, weights=vals, minlength=n)
    r_inv = np.power(rowsum, -1.0)
    r_inv[np.isinf(r_inv)] = 0.0
    return vals * r_inv[rows]


def sparse_mx_to_torch_sparse_tensor(rows, cols, vals, shape):
    """Convert a COO matrix to a torch sparse tensor (the legacy constructor)."""
    indices = torch.from_numpy(np.vstack((rows, cols)).astype(np.int64))
    values = torch.from_numpy(vals.astype(np.float32))
    shape = torch.Size(shape)
    return torch.sparse.FloatTensor(indices, values, shape)


def load_data():
    """A synthetic citation graph of Cora's sizes instead of cora.content / cora.cites."""
    rng = np.random.RandomState(args.seed)
    n, f, c = args.nodes, args.features, args.classes
    labels_raw = rng.randint(0, c, size=n)
    labels = encode_onehot(labels_raw)
    # bag of words: ~18 words a paper, binary
    features = (rng.rand(n, f) < 18.0 / f).astype(np.float32)
    features[np.arange(n), rng.randint(0, f, size=n)] = 1.0  # no empty rows
    # citations: random undirected edges, symmetrised, deduplicated, self-loops added
    src, dst = rng.randint(0, n, size=args.edges), rng.randint(0, n, size=args.edges)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    pairs = np.unique(np.concatenate([np.stack([src, dst], 1), np.stack([dst, src], 1)]), axis=0)
    rows = np.concatenate([pairs[:, 0], np.arange(n)])
    cols = np.concatenate([pairs[:, 1], np.arange(n)])
    vals = np.ones(len(rows), dtype=np.float64)
    features = normalize(features)
    vals = normalize_coo(rows, cols, vals, n)
    if gat:  # pyGAT: adj = torch.FloatTensor(np.array(adj.todense()))
        dense = np.zeros((n, n), dtype=np.float32)
        dense[rows, cols] = vals
        adj = torch.FloatTensor(dense)
    else:
        adj = sparse_mx_to_torch_sparse_tensor(rows, cols, vals, (n, n))
    idx_train = range(140)
    idx_val = range(200, 500)
    idx_test = range(500, 1500)
    features = torch.FloatTensor(np.array(features))
    labels = torch.LongTensor(np.where(labels)[1])
    idx_train = torch.LongTensor(idx_train)
    idx_val = torch.LongTensor(idx_val)
    idx_test = torch.LongTensor(idx_test)
    return adj, features, labels, idx_train, idx_val, idx_test


def accuracy(output, labels):
    preds = output.max(1)[1].type_as(labels)
    correct = preds.eq(labels).double()
    correct = correct.sum()
    return correct / len(labels)


# ---------------------------------------------------------------- layers.py / models.py (pygcn)
class GraphConvolution(Module):
    """Simple GCN layer, similar to https://arxiv.org/abs/1609.02907"""

    def __init__(self, in_features, out_features, bias=True):
        super(GraphConvolution, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(torch.FloatTensor(in_features, out_features))
        if bias:
            self.bias = Parameter(torch.FloatTensor(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        stdv = 1.0 / math.sqrt(self.weight.size(1))
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        support = torch.mm(input, self.weight)
        output = torch.spmm(adj, support)
        if self.bias is not None:
            return output + self.bias
        else:
            return output

    def __repr__(self):
        return self.__class__.__name__ + " (" + str(self.in_features) + " -> " + str(self.out_features) + ")"


class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout):
        super(GCN, self).__init__()
        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)


# ---------------------------------------------------------------- layers.py / models.py (pyGAT)
class GraphAttentionLayer(nn.Module):
    """Simple GAT layer, similar to https://arxiv.org/abs/1710.10903 (pyGAT's original version)."""

    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super(GraphAttentionLayer, self).__init__()
        self.dropout = dropout
        self.in_features = in_features
        self.out_features = out_features
        self.alpha = alpha
        self.concat = concat
        self.W = nn.Parameter(torch.zeros(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.zeros(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)

    def forward(self, input, adj):
        h = torch.mm(input, self.W)
        N = h.size()[0]
        a_input = torch.cat([h.repeat(1, N).view(N * N, -1), h.repeat(N, 1)], dim=1).view(N, -1, 2 * self.out_features)
        e = self.leakyrelu(torch.matmul(a_input, self.a).squeeze(2))
        zero_vec = -9e15 * torch.ones_like(e)
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, h)
        if self.concat:
            return F.elu(h_prime)
        else:
            return h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout, alpha, nheads):
        """Dense version of GAT."""
        super(GAT, self).__init__()
        self.dropout = dropout
        self.attentions = [GraphAttentionLayer(nfeat, nhid, dropout=dropout, alpha=alpha, concat=True)
                           for _ in range(nheads)]
        for i, attention in enumerate(self.attentions):
            self.add_module("attention_{}".format(i), attention)
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, dropout=dropout, alpha=alpha, concat=False)

    def forward(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        return F.log_softmax(x, dim=1)


# ---------------------------------------------------------------- train.py
adj, features, labels, idx_train, idx_val, idx_test = load_data()

if gat:
    model = GAT(nfeat=features.shape[1], nhid=args.hidden, nclass=int(labels.max()) + 1,
                dropout=args.dropout, nheads=args.nb_heads, alpha=args.alpha)
else:
    model = GCN(nfeat=features.shape[1], nhid=args.hidden, nclass=labels.max().item() + 1, dropout=args.dropout)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

if args.cuda:
    model.cuda()
    features = features.cuda()
    adj = adj.cuda()
    labels = labels.cuda()
    idx_train = idx_train.cuda()
    idx_val = idx_val.cuda()
    idx_test = idx_test.cuda()


def train(epoch):
    t = time.time()
    model.train()
    optimizer.zero_grad()
    output = model(features, adj)
    loss_train = F.nll_loss(output[idx_train], labels[idx_train])
    acc_train = accuracy(output[idx_train], labels[idx_train])
    loss_train.backward()
    optimizer.step()

    if not args.fastmode:
        # Evaluate validation set performance separately, deactivates dropout during validation run.
        model.eval()
        output = model(features, adj)

    loss_val = F.nll_loss(output[idx_val], labels[idx_val])
    acc_val = accuracy(output[idx_val], labels[idx_val])
    print("Epoch: {:04d}".format(epoch + 1),
          "loss_train: {:.4f}".format(loss_train.item()),
          "acc_train: {:.4f}".format(acc_train.item()),
          "loss_val: {:.4f}".format(loss_val.item()),
          "acc_val: {:.4f}".format(acc_val.item()),
          "time: {:.4f}s".format(time.time() - t))
    return loss_val.item()


def test():
    model.eval()
    output = model(features, adj)
    loss_test = F.nll_loss(output[idx_test], labels[idx_test])
    acc_test = accuracy(output[idx_test], labels[idx_test])
    print("Test set results:", "loss= {:.4f}".format(loss_test.item()), "accuracy= {:.4f}".format(acc_test.item()))


t_total = time.time()
for epoch in range(args.steps):
    train(epoch)
print("Optimization Finished!")
print("Total time elapsed: {:.4f}s".format(time.time() - t_total))
test()
