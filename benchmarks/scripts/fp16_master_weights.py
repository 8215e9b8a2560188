"""Mixed precision the old apex/Megatron "FP16_Optimizer" way, written by hand: a GPT-2-small model made with model.half(), an fp32 master copy of every parameter (p.detach().clone().float(), new leaf tensors) handed to torch.optim.Adam, a dynamic loss scale kept in Python (scale the loss, check every fp16 grad with torch.isfinite(...).all(), on overflow skip the step and halve the scale), fp16 grads copied into persistent fp32 master .grad buffers and unscaled, grad clipping on the masters, step, then p.data.copy_(master) back into the fp16 model."""
import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- model (GPT-2 small)
@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            # the softmax / cross entropy in fp32, as Megatron does
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# ----------------------------------------------------------------------------- fp16 optimizer pieces (apex-style)
class DynamicLossScaler:
    """Dynamic loss scaling, as in apex.fp16_utils.loss_scaler / fairseq."""

    def __init__(self, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=1000, min_scale=1.0):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale

    @property
    def loss_scale(self):
        return self.cur_scale

    @staticmethod
    def has_overflow(params):
        for p in params:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return True
        return False

    def update_scale(self, overflow):
        if overflow:
            if self.cur_scale <= self.min_scale:
                raise FloatingPointError(
                    f"Minimum loss scale reached ({self.min_scale}). Your loss is probably exploding. "
                    "Try lowering the learning rate, using gradient clipping or increasing the batch size.")
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def model_grads_to_master_grads(model_params, master_params, loss_scale):
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)
        master.grad.mul_(1.0 / loss_scale)


def master_params_to_model_params(model_params, master_params):
    with torch.no_grad():
        for model, master in zip(model_params, master_params):
            model.data.copy_(master.data)


def zero_model_grads(model_params):
    # apex FP16_Optimizer.zero_grad: keep the fp16 grad buffers, zero them in place
    for p in model_params:
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()


# ----------------------------------------------------------------------------- training
def get_args():
    parser = argparse.ArgumentParser(description="GPT-2 small, fp16 weights + fp32 master weights by hand")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--min-lr", type=float, default=6e-5)
    parser.add_argument("--warmup-iters", type=int, default=2)
    parser.add_argument("--lr-decay-iters", type=int, default=1000)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--init-loss-scale", type=float, default=2.0 ** 16)
    parser.add_argument("--loss-scale-window", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10, help="number of (non-skipped) optimizer updates")
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1337)
    return parser.parse_args()


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = "cuda"

    config = GPTConfig(block_size=args.block_size)
    model = GPT(config)
    model.cuda().half()
    print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    # fp32 master copy of the fp16 weights; the optimizer only ever sees the masters
    model_params = [p for p in model.parameters() if p.requires_grad]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad = True
    optimizer = torch.optim.Adam(master_params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    scaler = DynamicLossScaler(init_scale=args.init_loss_scale, scale_window=args.loss_scale_window)

    # learning rate decay scheduler (cosine with warmup)
    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        if it > args.lr_decay_iters:
            return args.min_lr
        decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return args.min_lr + coeff * (args.lr - args.min_lr)

    # a synthetic "train.bin" held in host memory
    train_data = torch.randint(0, 50257, (2_000_000,), dtype=torch.int32)

    def get_batch():
        ix = torch.randint(len(train_data) - args.block_size, (args.batch_size,))
        x = torch.stack([train_data[i:i + args.block_size].long() for i in ix])
        y = torch.stack([train_data[i + 1:i + 1 + args.block_size].long() for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model.train()
    num_updates = 0
    iteration = 0
    t0 = time.time()
    while num_updates < args.steps:
        lr = get_lr(num_updates)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        X, Y = get_batch()
        _, loss = model(X, Y)
        loss_scale = scaler.loss_scale
        (loss * loss_scale).backward()

        overflow = scaler.has_overflow(model_params)
        if not overflow:
            model_grads_to_master_grads(model_params, master_params, loss_scale)
        scaler.update_scale(overflow)
        iteration += 1
        if overflow:
            print(f"iter {iteration}: gradient overflow, skipping update, reducing loss scale to {scaler.loss_scale:g}")
            zero_model_grads(model_params)
            continue

        grad_norm = torch.nn.utils.clip_grad_norm_(master_params, args.grad_clip)
        optimizer.step()
        master_params_to_model_params(model_params, master_params)
        zero_model_grads(model_params)
        num_updates += 1

        if num_updates % args.log_interval == 0 or num_updates == 1:
            dt = time.time() - t0
            t0 = time.time()
            print(f"update {num_updates}: loss {loss.item():.4f}, grad norm {grad_norm.item():.3f}, "
                  f"loss scale {loss_scale:g}, lr {lr:.2e}, time {dt * 1000:.0f}ms, "
                  f"mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
