# Multi-task MLP-Mixer (shared encoder, classification + auxiliary rotation head), in the style of
# public multi-task repos (WeiChengTseng/Pytorch-PCGrad's pc_backward, lucidrains' mlp-mixer-pytorch)
# with the monitoring habits people bolt on: wandb.watch-style gradient logging (a tensor hook on
# every parameter appending its gradient's norm to a list, a register_full_backward_hook on each head
# recording grad_output norms), a register_forward_hook keeping a detached intermediate feature map in
# a dict between steps for a logging metric, two losses with two backward calls per optimizer step
# (loss_a.backward(retain_graph=True); loss_b.backward()), clip_grad_value_, and an optional PCGrad
# gradient surgery (per-task gradients of the shared parameters by torch.autograd.grad, projected,
# written into p.grad).
import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="multi-task mixer with gradient-logging hooks")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--img", type=int, default=32)
parser.add_argument("--patch", type=int, default=4)
parser.add_argument("--dim", type=int, default=128)
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--clip-value", type=float, default=1.0)
parser.add_argument("--log-freq", type=int, default=4)
parser.add_argument("--pcgrad", action="store_true")
parser.add_argument("--aux-weight", type=float, default=0.5)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
random.seed(0)


class PreNormResidual(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.fn(self.norm(x)) + x


def FeedForward(dim, expansion, dense=nn.Linear):
    inner = int(dim * expansion)
    return nn.Sequential(dense(dim, inner), nn.GELU(), nn.Dropout(0.0), dense(inner, dim), nn.Dropout(0.0))


class MixerEncoder(nn.Module):
    def __init__(self, img, patch, dim, depth, expansion=4, expansion_token=0.5):
        super().__init__()
        n = (img // patch) ** 2
        self.patch = patch
        self.to_tokens = nn.Linear(3 * patch * patch, dim)
        chan_first = lambda i, o: nn.Conv1d(i, o, kernel_size=1)
        self.blocks = nn.Sequential(*[
            nn.Sequential(PreNormResidual(dim, FeedForward(n, expansion_token, chan_first)),
                          PreNormResidual(dim, FeedForward(dim, expansion)))
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        b, c, h, w = x.shape
        p = self.patch
        x = x.unfold(2, p, p).unfold(3, p, p)                      # b c h/p w/p p p
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        x = self.to_tokens(x)
        x = self.blocks(x)
        return self.norm(x)


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = MixerEncoder(args.img, args.patch, args.dim, args.depth)
        self.cls_head = nn.Sequential(nn.Linear(args.dim, args.dim), nn.GELU(), nn.Linear(args.dim, args.num_classes))
        self.rot_head = nn.Sequential(nn.Linear(args.dim, args.dim), nn.GELU(), nn.Linear(args.dim, 4))

    def forward(self, x):
        feats = self.encoder(x)
        pooled = feats.mean(dim=1)
        return self.cls_head(pooled), self.rot_head(pooled)


model = MultiTaskNet().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
shared_params = [p for p in model.encoder.parameters() if p.requires_grad]

# --- wandb.watch(model, log="gradients", log_freq=...)-style monitoring --------------------------
grad_stats = []                       # per-parameter gradient norms, flushed every log_freq steps
head_grad_out = {"cls_head": [], "rot_head": []}
features = {}                         # forward-hook capture, kept between steps for a logging metric
for name, p in model.named_parameters():
    p.register_hook(lambda g, name=name: grad_stats.append(g.norm()))


def make_bwd_hook(key):
    def hook(module, grad_input, grad_output):
        head_grad_out[key].append(grad_output[0].detach().norm(dim=-1).mean())
    return hook


model.cls_head.register_full_backward_hook(make_bwd_hook("cls_head"))
model.rot_head.register_full_backward_hook(make_bwd_hook("rot_head"))


def capture(module, inputs, output):
    features["mid"] = output.detach()


model.encoder.blocks[len(model.encoder.blocks) // 2].register_forward_hook(capture)


def pcgrad_backward(losses):
    """PCGrad: per-task gradients of the shared parameters, each projected off the others' conflicts."""
    task_grads = []
    for loss in losses:
        gs = torch.autograd.grad(loss, shared_params, retain_graph=True, allow_unused=True)
        task_grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(shared_params, gs)])
    flat = [torch.cat([g.flatten() for g in gs]) for gs in task_grads]
    projected = []
    for i, gi in enumerate(flat):
        gi = gi.clone()
        order = [j for j in range(len(flat)) if j != i]
        random.shuffle(order)
        for j in order:
            dot = torch.dot(gi, flat[j])
            if dot < 0:
                gi -= dot * flat[j] / (flat[j].norm() ** 2)
        projected.append(gi)
    merged = torch.stack(projected).sum(0)
    offset = 0
    for p in shared_params:
        n = p.numel()
        p.grad = merged[offset:offset + n].view_as(p).clone()
        offset += n
    # heads: ordinary backward of the summed loss, only into the head parameters
    head_params = [p for n, p in model.named_parameters() if not n.startswith("encoder.")]
    sum(losses).backward(inputs=head_params)


def rotate_batch(x):
    k = torch.randint(0, 4, (x.shape[0],), device=x.device)
    out = torch.stack([torch.rot90(xi, int(ki), dims=(1, 2)) for xi, ki in zip(x, k.tolist())])
    return out, k


model.train()
for step in range(args.steps):
    images = torch.rand(args.batch_size, 3, args.img, args.img)
    labels = torch.randint(0, args.num_classes, (args.batch_size,))
    images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
    images, rot_labels = rotate_batch(images)

    optimizer.zero_grad(set_to_none=True)
    logits_cls, logits_rot = model(images)
    loss_a = F.cross_entropy(logits_cls, labels)
    loss_b = args.aux_weight * F.cross_entropy(logits_rot, rot_labels)
    if args.pcgrad:
        pcgrad_backward([loss_a, loss_b])
    else:
        loss_a.backward(retain_graph=True)
        loss_b.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)
    optimizer.step()

    feat_metric = features["mid"].float().std(dim=1).mean()
    if (step + 1) % args.log_freq == 0:
        gnorm = torch.stack(grad_stats).mean().item() if grad_stats else 0.0
        hnorms = {k: torch.stack(v).mean().item() for k, v in head_grad_out.items() if v}
        print(f"step {step + 1} loss_a {loss_a.item():.4f} loss_b {loss_b.item():.4f} "
              f"grad-norm {gnorm:.4f} heads {hnorms} feat-std {feat_metric.item():.4f}")
        grad_stats.clear()
        for v in head_grad_out.values():
            v.clear()

if torch.cuda.is_available():
    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
