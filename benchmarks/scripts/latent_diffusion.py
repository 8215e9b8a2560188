# Latent diffusion training, CompVis/diffusers style, written by hand: a UNet of ResBlocks (GroupNorm
# + SiLU, timestep embedding added), SpatialTransformer blocks (self- and cross-attention to text
# embeddings with F.scaled_dot_product_attention, GEGLU feed-forward) checkpointed with
# torch.utils.checkpoint, nearest-neighbour F.interpolate upsampling; a hand-written DDPM noise
# schedule (alphas_cumprod[t] gathered per sample), fp16 autocast with a GradScaler, EMA of the
# weights by torch._foreach_lerp_. Latents and text embeddings are precomputed (VAE / CLIP offline).
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--model_channels", type=int, default=224)
p.add_argument("--channel_mult", type=str, default="1,2,4,4")
p.add_argument("--num_res_blocks", type=int, default=2)
p.add_argument("--attention_levels", type=str, default="0,1,2")
p.add_argument("--num_heads", type=int, default=8)
p.add_argument("--context_dim", type=int, default=768)
p.add_argument("--context_len", type=int, default=77)
p.add_argument("--latent_channels", type=int, default=4)
p.add_argument("--latent_size", type=int, default=64)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--ema_decay", type=float, default=0.9999)
p.add_argument("--ucg", type=float, default=0.1, help="probability of dropping the text conditioning")
p.add_argument("--scaler", choices=["cuda.amp", "amp"], default="cuda.amp")
p.add_argument("--no_checkpoint", action="store_true")
p.add_argument("--device", default="cuda")
args = p.parse_args()

device = torch.device(args.device)
torch.manual_seed(0)


# ---------------------------------------------------------------- model
def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half).to(
        device=timesteps.device)
    args_ = timesteps[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args_), torch.sin(args_)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


def zero_module(module):
    for p_ in module.parameters():
        p_.detach().zero_()
    return module


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def normalization(channels):
    return GroupNorm32(32, channels)


class TimestepBlock(nn.Module):
    pass


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    def forward(self, x, emb, context=None):
        for layer in self:
            if isinstance(layer, TimestepBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            else:
                x = layer(x)
        return x


class Upsample(nn.Module):
    def __init__(self, channels, out_channels=None):
        super().__init__()
        self.conv = nn.Conv2d(channels, out_channels or channels, 3, padding=1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.conv(x)


class Downsample(nn.Module):
    def __init__(self, channels, out_channels=None):
        super().__init__()
        self.op = nn.Conv2d(channels, out_channels or channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class ResBlock(TimestepBlock):
    def __init__(self, channels, emb_channels, dropout=0.0, out_channels=None):
        super().__init__()
        self.out_channels = out_channels or channels
        self.in_layers = nn.Sequential(normalization(channels), nn.SiLU(), nn.Conv2d(channels, self.out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, self.out_channels))
        self.out_layers = nn.Sequential(
            normalization(self.out_channels), nn.SiLU(), nn.Dropout(p=dropout),
            zero_module(nn.Conv2d(self.out_channels, self.out_channels, 3, padding=1)))
        self.skip_connection = nn.Identity() if self.out_channels == channels else nn.Conv2d(channels, self.out_channels, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        emb_out = self.emb_layers(emb).type(h.dtype)
        h = h + emb_out[..., None, None]
        h = self.out_layers(h)
        return self.skip_connection(x) + h


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None):
        h = self.heads
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        b = q.shape[0]
        q, k, v = (t.view(b, -1, h, t.shape[-1] // h).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(b, -1, h * out.shape[-1])
        return self.to_out(out)


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        self.net = nn.Sequential(GEGLU(dim, inner_dim), nn.Dropout(dropout), nn.Linear(inner_dim, dim))

    def forward(self, x):
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, context_dim, checkpoint=True):
        super().__init__()
        self.attn1 = CrossAttention(query_dim=dim, heads=n_heads, dim_head=d_head)
        self.ff = FeedForward(dim)
        self.attn2 = CrossAttention(query_dim=dim, context_dim=context_dim, heads=n_heads, dim_head=d_head)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.checkpoint = checkpoint

    def forward(self, x, context=None):
        if self.checkpoint and self.training:
            return torch.utils.checkpoint.checkpoint(self._forward, x, context, use_reentrant=False)
        return self._forward(x, context)

    def _forward(self, x, context=None):
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context=context) + x
        x = self.ff(self.norm3(x)) + x
        return x


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels, n_heads, d_head, depth=1, context_dim=None, checkpoint=True):
        super().__init__()
        inner_dim = n_heads * d_head
        self.norm = normalization(in_channels)
        self.proj_in = nn.Conv2d(in_channels, inner_dim, 1)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner_dim, n_heads, d_head, context_dim=context_dim, checkpoint=checkpoint)
             for _ in range(depth)])
        self.proj_out = zero_module(nn.Conv2d(inner_dim, in_channels, 1))

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        x = self.proj_in(x)
        x = x.permute(0, 2, 3, 1).reshape(b, h * w, -1)
        for block in self.transformer_blocks:
            x = block(x, context=context)
        x = x.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous()
        x = self.proj_out(x)
        return x + x_in


class UNetModel(nn.Module):
    def __init__(self, in_channels, model_channels, out_channels, num_res_blocks, attention_levels, channel_mult,
                 num_heads, context_dim, checkpoint=True):
        super().__init__()
        self.model_channels = model_channels
        time_embed_dim = model_channels * 4
        self.time_embed = nn.Sequential(nn.Linear(model_channels, time_embed_dim), nn.SiLU(),
                                        nn.Linear(time_embed_dim, time_embed_dim))
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, model_channels, 3, padding=1))])
        input_block_chans = [model_channels]
        ch = model_channels
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [ResBlock(ch, time_embed_dim, out_channels=mult * model_channels)]
                ch = mult * model_channels
                if level in attention_levels:
                    layers.append(SpatialTransformer(ch, num_heads, ch // num_heads, context_dim=context_dim,
                                                     checkpoint=checkpoint))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                input_block_chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                input_block_chans.append(ch)
        self.middle_block = TimestepEmbedSequential(
            ResBlock(ch, time_embed_dim),
            SpatialTransformer(ch, num_heads, ch // num_heads, context_dim=context_dim, checkpoint=checkpoint),
            ResBlock(ch, time_embed_dim))
        self.output_blocks = nn.ModuleList([])
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                ich = input_block_chans.pop()
                layers = [ResBlock(ch + ich, time_embed_dim, out_channels=model_channels * mult)]
                ch = model_channels * mult
                if level in attention_levels:
                    layers.append(SpatialTransformer(ch, num_heads, ch // num_heads, context_dim=context_dim,
                                                     checkpoint=checkpoint))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch))
                self.output_blocks.append(TimestepEmbedSequential(*layers))
        self.out = nn.Sequential(normalization(ch), nn.SiLU(),
                                 zero_module(nn.Conv2d(model_channels, out_channels, 3, padding=1)))

    def forward(self, x, timesteps, context):
        hs = []
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels))
        h = x
        for module in self.input_blocks:
            h = module(h, emb, context)
            hs.append(h)
        h = self.middle_block(h, emb, context)
        for module in self.output_blocks:
            h = torch.cat([h, hs.pop()], dim=1)
            h = module(h, emb, context)
        return self.out(h)


# ---------------------------------------------------------------- DDPM schedule (hand-written)
class DDPMSchedule:
    def __init__(self, num_timesteps=1000, linear_start=0.00085, linear_end=0.012, device="cpu"):
        betas = torch.linspace(linear_start ** 0.5, linear_end ** 0.5, num_timesteps, dtype=torch.float64) ** 2
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_timesteps = num_timesteps
        self.alphas_cumprod = alphas_cumprod.to(device=device, dtype=torch.float32)
        self.sqrt_alphas_cumprod = torch.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = torch.sqrt(1.0 - self.alphas_cumprod)

    def q_sample(self, x_start, t, noise):
        a = self.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1)
        s = self.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1)
        return a * x_start + s * noise


# ---------------------------------------------------------------- data (precomputed latents + text embeddings)
class LatentTextDataset(Dataset):
    def __init__(self, n, c, size, ctx_len, ctx_dim):
        self.n, self.c, self.size, self.ctx_len, self.ctx_dim = n, c, size, ctx_len, ctx_dim

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        latent = torch.randn(self.c, self.size, self.size, generator=g) * 0.18215
        context = torch.randn(self.ctx_len, self.ctx_dim, generator=g)
        return latent, context


model = UNetModel(in_channels=args.latent_channels, model_channels=args.model_channels,
                  out_channels=args.latent_channels, num_res_blocks=args.num_res_blocks,
                  attention_levels=[int(a) for a in args.attention_levels.split(",") if a],
                  channel_mult=[int(m) for m in args.channel_mult.split(",")], num_heads=args.num_heads,
                  context_dim=args.context_dim, checkpoint=not args.no_checkpoint).to(device)
n_params = sum(p_.numel() for p_ in model.parameters())
print(f"UNet parameters: {n_params / 1e6:.1f}M")

# EMA of the weights as a list of tensors (LitEma / diffusers EMAModel shadow params)
ema_params = [p_.detach().clone() for p_ in model.parameters()]

schedule = DDPMSchedule(device=device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
if args.scaler == "cuda.amp":
    scaler = torch.cuda.amp.GradScaler()
else:
    scaler = torch.amp.GradScaler("cuda")

loader = DataLoader(LatentTextDataset(args.batch * args.steps, args.latent_channels, args.latent_size,
                                      args.context_len, args.context_dim),
                    batch_size=args.batch, shuffle=True, drop_last=True, pin_memory=device.type == "cuda")
null_context = torch.zeros(1, args.context_len, args.context_dim, device=device)

model.train()
for step, (latents, context) in enumerate(loader):
    t0 = time.time()
    latents = latents.to(device, non_blocking=True)
    context = context.to(device, non_blocking=True)
    bsz = latents.shape[0]
    # classifier-free guidance training: drop the text for a fraction of the samples
    drop = torch.rand(bsz, device=device) < args.ucg
    context = torch.where(drop[:, None, None], null_context, context)
    t = torch.randint(0, schedule.num_timesteps, (bsz,), device=device).long()
    noise = torch.randn_like(latents)
    noisy = schedule.q_sample(latents, t, noise)

    with torch.autocast("cuda", dtype=torch.float16, enabled=device.type == "cuda"):
        pred = model(noisy, t, context)
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")

    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()

    with torch.no_grad():
        torch._foreach_lerp_(ema_params, [p_.detach() for p_ in model.parameters()], 1.0 - args.ema_decay)

    print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} scale {scaler.get_scale():.0f} "
          f"{time.time() - t0:.2f}s")
