# text-to-image fine-tune, diffusers train_text_to_image.py style (no diffusers/accelerate)
import argparse, math, copy, logging
import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--max_train_steps", type=int, default=6)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--mixed_precision", default="fp16")
    p.add_argument("--use_ema", action="store_true", default=True)
    p.add_argument("--snr_gamma", type=float, default=5.0)
    p.add_argument("--base", type=int, default=192)
    p.add_argument("--device", default="cuda")
    return p.parse_args()

# ---------------- tiny CLIP-ish text encoder ----------------
class TextEncoder(nn.Module):
    def __init__(self, vocab=49408, dim=768, layers=6, heads=12, max_len=77):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Parameter(torch.zeros(max_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.final_layer_norm = nn.LayerNorm(dim)
    def forward(self, input_ids):
        x = self.token_embedding(input_ids) + self.position_embedding[: input_ids.shape[1]]
        return (self.final_layer_norm(self.encoder(x)),)

# ---------------- tiny VAE (encoder only needed) ----------------
class DiagonalGaussian:
    def __init__(self, parameters):
        self.mean, self.logvar = torch.chunk(parameters, 2, dim=1)
        self.logvar = torch.clamp(self.logvar, -30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)
    def sample(self, generator=None):
        return self.mean + self.std * torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)

class VAEEncoder(nn.Module):
    def __init__(self, ch=(128, 256, 512, 512), z=4):
        super().__init__()
        layers = [nn.Conv2d(3, ch[0], 3, padding=1)]
        for i in range(len(ch) - 1):
            layers += [nn.GroupNorm(32, ch[i]), nn.SiLU(), nn.Conv2d(ch[i], ch[i + 1], 3, stride=2, padding=1)]
        layers += [nn.GroupNorm(32, ch[-1]), nn.SiLU(), nn.Conv2d(ch[-1], 2 * z, 3, padding=1)]
        self.net = nn.Sequential(*layers)
        self.quant_conv = nn.Conv2d(2 * z, 2 * z, 1)
    def forward(self, x):
        return self.quant_conv(self.net(x))

class AutoencoderKL(nn.Module):
    class _Out:
        def __init__(self, d): self.latent_dist = d
    def __init__(self):
        super().__init__()
        self.encoder = VAEEncoder()
        self.config = type("cfg", (), {"scaling_factor": 0.18215})()
    def encode(self, x):
        return AutoencoderKL._Out(DiagonalGaussian(self.encoder(x)))

# ---------------- tiny UNet ----------------
def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin); self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(32, cout); self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(t))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)

class CrossAttn(nn.Module):
    def __init__(self, c, ctx_dim, heads=8):
        super().__init__()
        self.norm = nn.GroupNorm(32, c); self.heads = heads
        self.q = nn.Linear(c, c, bias=False); self.k = nn.Linear(ctx_dim, c, bias=False)
        self.v = nn.Linear(ctx_dim, c, bias=False); self.o = nn.Linear(c, c)
    def forward(self, x, ctx):
        b, c, h, w = x.shape
        y = self.norm(x).reshape(b, c, h * w).transpose(1, 2)
        q = self.q(y).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        k = self.k(ctx).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        v = self.v(ctx).view(b, -1, self.heads, c // self.heads).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return x + self.o(o).transpose(1, 2).reshape(b, c, h, w)

class UNet2DConditionModel(nn.Module):
    def __init__(self, base=192, ctx_dim=768):
        super().__init__()
        tdim = base * 4
        self.base = base
        self.time_mlp = nn.Sequential(nn.Linear(base, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(4, base, 3, padding=1)
        chs = [base, base * 2, base * 4]
        self.down = nn.ModuleList(); self.down_attn = nn.ModuleList(); self.downsample = nn.ModuleList()
        cin = base
        for i, c in enumerate(chs):
            self.down.append(ResBlock(cin, c, tdim)); self.down_attn.append(CrossAttn(c, ctx_dim))
            self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1) if i < len(chs) - 1 else nn.Identity())
            cin = c
        self.mid1 = ResBlock(cin, cin, tdim); self.mid_attn = CrossAttn(cin, ctx_dim); self.mid2 = ResBlock(cin, cin, tdim)
        self.up = nn.ModuleList(); self.up_attn = nn.ModuleList(); self.upsample = nn.ModuleList()
        for i, c in enumerate(reversed(chs)):
            self.up.append(ResBlock(cin + c, c, tdim)); self.up_attn.append(CrossAttn(c, ctx_dim))
            self.upsample.append(nn.Upsample(scale_factor=2, mode="nearest") if i < len(chs) - 1 else nn.Identity())
            cin = c
        self.norm_out = nn.GroupNorm(32, cin); self.conv_out = nn.Conv2d(cin, 4, 3, padding=1)
    def forward(self, sample, timestep, encoder_hidden_states, return_dict=False):
        t = self.time_mlp(timestep_embedding(timestep, self.base))
        h = self.conv_in(sample); skips = []
        for rb, at, ds in zip(self.down, self.down_attn, self.downsample):
            h = at(rb(h, t), encoder_hidden_states); skips.append(h); h = ds(h)
        h = self.mid2(self.mid_attn(self.mid1(h, t), encoder_hidden_states), t)
        for rb, at, us in zip(self.up, self.up_attn, self.upsample):
            s = skips.pop()
            if h.shape[-1] != s.shape[-1]:
                h = F.interpolate(h, size=s.shape[-2:])
            h = at(rb(torch.cat([h, s], 1), t), encoder_hidden_states); h = us(h)
        return (self.conv_out(F.silu(self.norm_out(h))),)

# ---------------- DDPM scheduler ----------------
class DDPMScheduler:
    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012):
        self.config = type("cfg", (), {"num_train_timesteps": num_train_timesteps, "prediction_type": "epsilon"})()
        self.betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float32) ** 2
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
    def add_noise(self, original_samples, noise, timesteps):
        self.alphas_cumprod = self.alphas_cumprod.to(device=original_samples.device)
        alphas_cumprod = self.alphas_cumprod.to(dtype=original_samples.dtype)
        sqrt_alpha_prod = alphas_cumprod[timesteps] ** 0.5
        sqrt_alpha_prod = sqrt_alpha_prod.flatten()
        while len(sqrt_alpha_prod.shape) < len(original_samples.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
        sqrt_one_minus_alpha_prod = (1 - alphas_cumprod[timesteps]) ** 0.5
        sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.flatten()
        while len(sqrt_one_minus_alpha_prod.shape) < len(original_samples.shape):
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod * original_samples + sqrt_one_minus_alpha_prod * noise

def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod
    sqrt_alphas_cumprod = alphas_cumprod**0.5
    sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod) ** 0.5
    sqrt_alphas_cumprod = sqrt_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    sqrt_one_minus_alphas_cumprod = sqrt_one_minus_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    alpha = sqrt_alphas_cumprod
    sigma = sqrt_one_minus_alphas_cumprod
    return (alpha / sigma) ** 2

# ---------------- EMA (hand-written, shadow params as list) ----------------
class EMAModel:
    def __init__(self, parameters, decay=0.9999):
        parameters = list(parameters)
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay
        self.optimization_step = 0
    @torch.no_grad()
    def step(self, parameters):
        self.optimization_step += 1
        decay = min(self.decay, (1 + self.optimization_step) / (10 + self.optimization_step))
        one_minus_decay = 1 - decay
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)
    def to(self, device=None, dtype=None):
        self.shadow_params = [p.to(device=device, dtype=dtype) if p.is_floating_point() else p.to(device=device) for p in self.shadow_params]

def main():
    args = parse_args()
    device = torch.device(args.device)
    weight_dtype = torch.float32
    if args.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif args.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16

    noise_scheduler = DDPMScheduler()
    text_encoder = TextEncoder()
    vae = AutoencoderKL()
    unet = UNet2DConditionModel(base=args.base)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()

    if args.use_ema:
        ema_unet = EMAModel(unet.parameters())

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-08)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 500))

    unet.to(device)
    text_encoder.to(device, dtype=weight_dtype)
    vae.to(device, dtype=weight_dtype)
    if args.use_ema:
        ema_unet.to(device)

    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision == "fp16" and device.type == "cuda")
    logger.info(f"unet params: {sum(p.numel() for p in unet.parameters())/1e6:.1f}M")
    print(f"unet params: {sum(p.numel() for p in unet.parameters())/1e6:.1f}M  text {sum(p.numel() for p in text_encoder.parameters())/1e6:.1f}M vae {sum(p.numel() for p in vae.parameters())/1e6:.1f}M")

    global_step = 0
    train_loss = 0.0
    for step in range(args.max_train_steps):
        # fake batch (DataLoader collate output)
        batch = {
            "pixel_values": torch.randn(args.train_batch_size, 3, args.resolution, args.resolution).to(device),
            "input_ids": torch.randint(0, 49408, (args.train_batch_size, 77)).to(device),
        }
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.mixed_precision == "fp16"):
            latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device)
            timesteps = timesteps.long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(batch["input_ids"], )[0]
            target = noise
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()

        avg_loss = loss.detach().item()
        train_loss += avg_loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if args.use_ema:
            ema_unet.step(unet.parameters())
        global_step += 1
        print(f"step {global_step} loss {train_loss:.4f} lr {lr_scheduler.get_last_lr()[0]:.2e}")
        train_loss = 0.0

if __name__ == "__main__":
    main()
