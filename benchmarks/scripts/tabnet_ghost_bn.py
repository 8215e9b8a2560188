"""TabNet on random tabular data (categorical + numerical features).

Imitates dreamquark-ai/pytorch-tabnet (pytorch_tabnet/tab_network.py,
sparsemax.py, abstract_model.py), the network and training loop as written there:

  * GBN: ghost batch norm, ``x.chunk(int(np.ceil(x.shape[0] / vbs)), 0)``, one
    BatchNorm1d over every virtual batch of 128, ``torch.cat(res, dim=0)``;
  * GLU_Layer (Linear without bias -> GBN -> x[:, :d] * sigmoid(x[:, d:])),
    GLU_Block with ``scale = torch.sqrt(torch.FloatTensor([0.5]).to(x.device))``
    (a legacy constructor, copied to the device every call), shared Linear layers
    reused by every FeatTransformer (one weight in many modules);
  * AttentiveTransformer with sparsemax as a custom ``torch.autograd.Function``
    (forward: in-place ``input -= max``, sort, cumsum, support, gather of tau,
    clamp; saves (supp_size, output); backward: ``grad_input[output == 0] = 0``,
    a boolean-mask write, then torch.where);
  * TabNetEncoder: ``prior = torch.ones((bs, attention_dim)).to(x.device)``
    made on the host inside forward, ``M_loss += mean(sum(M * log(M + eps)))``,
    ``ReLU()(...)`` built inside forward, group_attention_matrix a plain tensor
    attribute on the device (not a buffer), n_steps decision steps;
  * EmbeddingGenerator: a loop over columns of a float X, ``.long()`` for the
    categorical ones, ``.float().view(-1, 1)`` for the numerical ones, torch.cat;
  * training loop of TabModel: DataLoader(TensorDataset, batch_size=1024,
    shuffle=True, drop_last=False) (the last batch of an epoch is smaller),
    ``X.to(device).float()``, ``for p in network.parameters(): p.grad = None``,
    ``loss = loss - lambda_sparse * M_loss``, clip_grad_norm_, Adam(lr=2e-2),
    StepLR stepped every epoch, ``loss.cpu().detach().numpy().item()`` logging,
    and an end-of-epoch prediction with ``network.eval()`` but no torch.no_grad()
    (pytorch-tabnet's _predict_batch), converted with ``.cpu().detach().numpy()``.
"""
import argparse

import numpy as np
import torch
from torch.autograd import Function
from torch.nn import BatchNorm1d, Linear, ReLU
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=1024)
parser.add_argument("--virtual-batch-size", type=int, default=128)
parser.add_argument("--n-train", type=int, default=5000)
parser.add_argument("--n-valid", type=int, default=2048)
parser.add_argument("--n-d", type=int, default=64)
parser.add_argument("--n-a", type=int, default=64)
parser.add_argument("--n-steps", type=int, default=5)
parser.add_argument("--gamma", type=float, default=1.5)
parser.add_argument("--lambda-sparse", type=float, default=1e-4)
parser.add_argument("--n-classes", type=int, default=7)
args = parser.parse_args()

torch.manual_seed(0)
np.random.seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------- sparsemax.py
def _make_ix_like(input, dim=0):
    d = input.size(dim)
    rho = torch.arange(1, d + 1, device=input.device, dtype=input.dtype)
    view = [1] * input.dim()
    view[0] = -1
    return rho.view(view).transpose(0, dim)


class SparsemaxFunction(Function):
    @staticmethod
    def forward(ctx, input, dim=-1):
        ctx.dim = dim
        max_val, _ = input.max(dim=dim, keepdim=True)
        input -= max_val  # same numerical stability trick as for softmax
        tau, supp_size = SparsemaxFunction._threshold_and_support(input, dim=dim)
        output = torch.clamp(input - tau, min=0)
        ctx.save_for_backward(supp_size, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        supp_size, output = ctx.saved_tensors
        dim = ctx.dim
        grad_input = grad_output.clone()
        grad_input[output == 0] = 0
        v_hat = grad_input.sum(dim=dim) / supp_size.to(output.dtype).squeeze()
        v_hat = v_hat.unsqueeze(dim)
        grad_input = torch.where(output != 0, grad_input - v_hat, grad_input)
        return grad_input, None

    @staticmethod
    def _threshold_and_support(input, dim=-1):
        input_srt, _ = torch.sort(input, descending=True, dim=dim)
        input_cumsum = input_srt.cumsum(dim) - 1
        rhos = _make_ix_like(input, dim)
        support = rhos * input_srt > input_cumsum
        support_size = support.sum(dim=dim).unsqueeze(dim)
        tau = input_cumsum.gather(dim, support_size - 1)
        tau /= support_size.to(input.dtype)
        return tau, support_size


sparsemax = SparsemaxFunction.apply


class Sparsemax(torch.nn.Module):
    def __init__(self, dim=-1):
        self.dim = dim
        super().__init__()

    def forward(self, input):
        return sparsemax(input, self.dim)


# ---------------------------------------------------------------- tab_network.py
def initialize_non_glu(module, input_dim, output_dim):
    gain_value = np.sqrt((input_dim + output_dim) / np.sqrt(4 * input_dim))
    torch.nn.init.xavier_normal_(module.weight, gain=gain_value)


def initialize_glu(module, input_dim, output_dim):
    gain_value = np.sqrt((input_dim + output_dim) / np.sqrt(input_dim))
    torch.nn.init.xavier_normal_(module.weight, gain=gain_value)


class GBN(torch.nn.Module):
    """Ghost Batch Normalization https://arxiv.org/abs/1705.08741"""

    def __init__(self, input_dim, virtual_batch_size=128, momentum=0.01):
        super().__init__()
        self.input_dim = input_dim
        self.virtual_batch_size = virtual_batch_size
        self.bn = BatchNorm1d(self.input_dim, momentum=momentum)

    def forward(self, x):
        chunks = x.chunk(int(np.ceil(x.shape[0] / self.virtual_batch_size)), 0)
        res = [self.bn(x_) for x_ in chunks]
        return torch.cat(res, dim=0)


class GLU_Layer(torch.nn.Module):
    def __init__(self, input_dim, output_dim, fc=None, virtual_batch_size=128, momentum=0.02):
        super().__init__()
        self.output_dim = output_dim
        if fc:
            self.fc = fc
        else:
            self.fc = Linear(input_dim, 2 * output_dim, bias=False)
        initialize_glu(self.fc, input_dim, 2 * output_dim)
        self.bn = GBN(2 * output_dim, virtual_batch_size=virtual_batch_size, momentum=momentum)

    def forward(self, x):
        x = self.fc(x)
        x = self.bn(x)
        out = torch.mul(x[:, : self.output_dim], torch.sigmoid(x[:, self.output_dim:]))
        return out


class GLU_Block(torch.nn.Module):
    def __init__(self, input_dim, output_dim, n_glu=2, first=False, shared_layers=None,
                 virtual_batch_size=128, momentum=0.02):
        super().__init__()
        self.first = first
        self.shared_layers = shared_layers
        self.n_glu = n_glu
        self.glu_layers = torch.nn.ModuleList()
        params = {"virtual_batch_size": virtual_batch_size, "momentum": momentum}
        fc = shared_layers[0] if shared_layers else None
        self.glu_layers.append(GLU_Layer(input_dim, output_dim, fc=fc, **params))
        for glu_id in range(1, self.n_glu):
            fc = shared_layers[glu_id] if shared_layers else None
            self.glu_layers.append(GLU_Layer(output_dim, output_dim, fc=fc, **params))

    def forward(self, x):
        scale = torch.sqrt(torch.FloatTensor([0.5]).to(x.device))
        if self.first:  # the first layer of the block has no scale multiplication
            x = self.glu_layers[0](x)
            layers_left = range(1, self.n_glu)
        else:
            layers_left = range(self.n_glu)
        for glu_id in layers_left:
            x = torch.add(x, self.glu_layers[glu_id](x))
            x = x * scale
        return x


class FeatTransformer(torch.nn.Module):
    def __init__(self, input_dim, output_dim, shared_layers, n_glu_independent,
                 virtual_batch_size=128, momentum=0.02):
        super().__init__()
        params = {"n_glu": n_glu_independent, "virtual_batch_size": virtual_batch_size, "momentum": momentum}
        if shared_layers is None:
            self.shared = torch.nn.Identity()
            is_first = True
        else:
            self.shared = GLU_Block(input_dim, output_dim, first=True, shared_layers=shared_layers,
                                    n_glu=len(shared_layers), virtual_batch_size=virtual_batch_size,
                                    momentum=momentum)
            is_first = False
        if n_glu_independent == 0:
            self.specifics = torch.nn.Identity()
        else:
            spec_input_dim = input_dim if is_first else output_dim
            self.specifics = GLU_Block(spec_input_dim, output_dim, first=is_first, **params)

    def forward(self, x):
        x = self.shared(x)
        x = self.specifics(x)
        return x


class AttentiveTransformer(torch.nn.Module):
    def __init__(self, input_dim, group_dim, group_matrix, virtual_batch_size=128, momentum=0.02):
        super().__init__()
        self.fc = Linear(input_dim, group_dim, bias=False)
        initialize_non_glu(self.fc, input_dim, group_dim)
        self.bn = GBN(group_dim, virtual_batch_size=virtual_batch_size, momentum=momentum)
        self.selector = Sparsemax(dim=-1)

    def forward(self, priors, processed_feat):
        x = self.fc(processed_feat)
        x = self.bn(x)
        x = torch.mul(x, priors)
        x = self.selector(x)
        return x


class TabNetEncoder(torch.nn.Module):
    def __init__(self, input_dim, output_dim, n_d=8, n_a=8, n_steps=3, gamma=1.3, n_independent=2,
                 n_shared=2, epsilon=1e-15, virtual_batch_size=128, momentum=0.02,
                 group_attention_matrix=None):
        super().__init__()
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.n_d = n_d
        self.n_a = n_a
        self.n_steps = n_steps
        self.gamma = gamma
        self.epsilon = epsilon
        self.n_independent = n_independent
        self.n_shared = n_shared
        self.virtual_batch_size = virtual_batch_size
        self.initial_bn = BatchNorm1d(self.input_dim, momentum=0.01)
        self.group_attention_matrix = group_attention_matrix
        if self.group_attention_matrix is None:
            self.group_attention_matrix = torch.eye(self.input_dim)
            self.attention_dim = self.input_dim
        else:
            self.attention_dim = self.group_attention_matrix.shape[0]

        if self.n_shared > 0:
            shared_feat_transform = torch.nn.ModuleList()
            for i in range(self.n_shared):
                if i == 0:
                    shared_feat_transform.append(Linear(self.input_dim, 2 * (n_d + n_a), bias=False))
                else:
                    shared_feat_transform.append(Linear(n_d + n_a, 2 * (n_d + n_a), bias=False))
        else:
            shared_feat_transform = None

        self.initial_splitter = FeatTransformer(self.input_dim, n_d + n_a, shared_feat_transform,
                                                n_glu_independent=self.n_independent,
                                                virtual_batch_size=self.virtual_batch_size, momentum=momentum)
        self.feat_transformers = torch.nn.ModuleList()
        self.att_transformers = torch.nn.ModuleList()
        for step in range(n_steps):
            transformer = FeatTransformer(self.input_dim, n_d + n_a, shared_feat_transform,
                                          n_glu_independent=self.n_independent,
                                          virtual_batch_size=self.virtual_batch_size, momentum=momentum)
            attention = AttentiveTransformer(n_a, self.attention_dim, group_matrix=group_attention_matrix,
                                             virtual_batch_size=self.virtual_batch_size, momentum=momentum)
            self.feat_transformers.append(transformer)
            self.att_transformers.append(attention)

    def forward(self, x, prior=None):
        x = self.initial_bn(x)
        bs = x.shape[0]  # batch size
        if prior is None:
            prior = torch.ones((bs, self.attention_dim)).to(x.device)
        M_loss = 0
        att = self.initial_splitter(x)[:, self.n_d:]
        steps_output = []
        for step in range(self.n_steps):
            M = self.att_transformers[step](prior, att)
            M_loss += torch.mean(torch.sum(torch.mul(M, torch.log(M + self.epsilon)), dim=1))
            # update prior
            prior = torch.mul(self.gamma - M, prior)
            # output
            M_feature_level = torch.matmul(M, self.group_attention_matrix)
            masked_x = torch.mul(M_feature_level, x)
            out = self.feat_transformers[step](masked_x)
            d = ReLU()(out[:, : self.n_d])
            steps_output.append(d)
            # update attention
            att = out[:, self.n_d:]
        M_loss /= self.n_steps
        return steps_output, M_loss


class TabNetNoEmbeddings(torch.nn.Module):
    def __init__(self, input_dim, output_dim, n_d=8, n_a=8, n_steps=3, gamma=1.3, n_independent=2,
                 n_shared=2, epsilon=1e-15, virtual_batch_size=128, momentum=0.02,
                 group_attention_matrix=None):
        super().__init__()
        self.encoder = TabNetEncoder(input_dim=input_dim, output_dim=output_dim, n_d=n_d, n_a=n_a,
                                     n_steps=n_steps, gamma=gamma, n_independent=n_independent,
                                     n_shared=n_shared, epsilon=epsilon,
                                     virtual_batch_size=virtual_batch_size, momentum=momentum,
                                     group_attention_matrix=group_attention_matrix)
        self.final_mapping = Linear(n_d, output_dim, bias=False)
        initialize_non_glu(self.final_mapping, n_d, output_dim)

    def forward(self, x):
        res = 0
        steps_output, M_loss = self.encoder(x)
        res = torch.sum(torch.stack(steps_output, dim=0), dim=0)
        out = self.final_mapping(res)
        return out, M_loss


class EmbeddingGenerator(torch.nn.Module):
    def __init__(self, input_dim, cat_dims, cat_idxs, cat_emb_dims):
        super().__init__()
        self.post_embed_dim = int(input_dim + np.sum(cat_emb_dims) - len(cat_emb_dims))
        self.embeddings = torch.nn.ModuleList()
        for cat_dim, emb_dim in zip(cat_dims, cat_emb_dims):
            self.embeddings.append(torch.nn.Embedding(cat_dim, emb_dim))
        # record continuous indices
        self.continuous_idx = torch.ones(input_dim, dtype=torch.bool)
        self.continuous_idx[cat_idxs] = 0

    def forward(self, x):
        cols = []
        cat_feat_counter = 0
        for feat_init_idx, is_continuous in enumerate(self.continuous_idx):
            if is_continuous:
                cols.append(x[:, feat_init_idx].float().view(-1, 1))
            else:
                cols.append(self.embeddings[cat_feat_counter](x[:, feat_init_idx].long()))
                cat_feat_counter += 1
        post_embeddings = torch.cat(cols, dim=1)
        return post_embeddings


class TabNet(torch.nn.Module):
    def __init__(self, input_dim, output_dim, cat_idxs, cat_dims, cat_emb_dim, group_attention_matrix=None,
                 **kwargs):
        super().__init__()
        self.embedder = EmbeddingGenerator(input_dim, cat_dims, cat_idxs, [cat_emb_dim] * len(cat_idxs))
        self.post_embed_dim = self.embedder.post_embed_dim
        self.tabnet = TabNetNoEmbeddings(self.post_embed_dim, output_dim,
                                         group_attention_matrix=group_attention_matrix, **kwargs)

    def forward(self, x):
        x = self.embedder(x)
        return self.tabnet(x)


# ---------------------------------------------------------------- data
n_num, n_cat = 30, 12
cat_dims = list(np.random.randint(5, 2000, size=n_cat))
input_dim = n_num + n_cat
cat_idxs = list(range(n_num, input_dim))
cat_emb_dim = 3


def make_X(n):
    num = np.random.randn(n, n_num).astype(np.float32)
    cat = np.stack([np.random.randint(0, d, size=n) for d in cat_dims], axis=1).astype(np.float32)
    return np.concatenate([num, cat], axis=1)


X_train, y_train = make_X(args.n_train), np.random.randint(0, args.n_classes, size=args.n_train)
X_valid, y_valid = make_X(args.n_valid), np.random.randint(0, args.n_classes, size=args.n_valid)
train_loader = DataLoader(TensorDataset(torch.from_numpy(X_train), torch.from_numpy(y_train)),
                          batch_size=args.batch_size, shuffle=True, drop_last=False)
valid_loader = DataLoader(TensorDataset(torch.from_numpy(X_valid), torch.from_numpy(y_valid)),
                          batch_size=args.batch_size, shuffle=False)

# pytorch-tabnet >= 4: the group matrix is made on the host and copied to the device by hand
post_embed_dim = n_num + n_cat * cat_emb_dim
group_matrix = torch.eye(post_embed_dim)
network = TabNet(input_dim, args.n_classes, cat_idxs, cat_dims, cat_emb_dim,
                 group_attention_matrix=group_matrix.to(device),
                 n_d=args.n_d, n_a=args.n_a, n_steps=args.n_steps, gamma=args.gamma,
                 n_independent=2, n_shared=2, virtual_batch_size=args.virtual_batch_size,
                 momentum=0.02).to(device)

optimizer = torch.optim.Adam(network.parameters(), lr=2e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
loss_fn = torch.nn.functional.cross_entropy
clip_value = 1.0


def train_batch(X, y):
    X = X.to(device).float()
    y = y.to(device).long()
    for param in network.parameters():
        param.grad = None
    output, M_loss = network(X)
    loss = loss_fn(output, y)
    loss = loss - args.lambda_sparse * M_loss
    loss.backward()
    if clip_value:
        torch.nn.utils.clip_grad_norm_(network.parameters(), clip_value)
    optimizer.step()
    return {"batch_size": X.shape[0], "loss": loss.cpu().detach().numpy().item()}


def predict_epoch():
    network.eval()
    list_y_score = []
    for X, _ in valid_loader:
        X = X.to(device).float()
        scores, _ = network(X)  # as pytorch-tabnet's _predict_batch: no torch.no_grad()
        list_y_score.append(torch.softmax(scores, dim=1).cpu().detach().numpy())
    network.train()
    return np.vstack(list_y_score)


step, epoch = 0, 0
while step < args.steps:
    network.train()
    for X, y in train_loader:
        logs = train_batch(X, y)
        step += 1
        if step >= args.steps:
            break
    scores = predict_epoch()
    acc = float((scores.argmax(1) == y_valid).mean())
    scheduler.step()
    print(f"epoch {epoch} step {step} loss {logs['loss']:.4f} valid acc {acc:.3f}")
    epoch += 1
print("done")
