# Conformer CTC speech recognition (torchaudio.models.Conformer's structure, hand-written so that torchaudio
# is not needed; ESPnet/WeNet-style Conv2d subsampling front end). Log-mel features are computed on the GPU
# from raw 16 kHz waveforms with torch.stft and a mel filterbank matrix; variable-length utterances are
# padded by a collate_fn in a DataLoader with workers and pinned memory. bf16 autocast, CTC, Adam + Noam.
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def get_args():
    parser = argparse.ArgumentParser(description="Conformer-CTC on synthetic LibriSpeech-shaped data")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--sample-rate", type=int, default=16000)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=8.0)
    parser.add_argument("--n-fft", type=int, default=400)
    parser.add_argument("--hop-length", type=int, default=160)
    parser.add_argument("--n-mels", type=int, default=80)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--kernel-size", type=int, default=31)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--vocab-size", type=int, default=256, help="sentencepiece units incl. blank")
    parser.add_argument("--warmup-steps", type=int, default=25000)
    parser.add_argument("--lr-factor", type=float, default=5.0)
    parser.add_argument("--clip-grad-norm", type=float, default=5.0)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ----------------------------------------------------------------------------- data

class SyntheticSpeech(Dataset):
    """Stands in for LibriSpeech: random waveforms of 2-8 s and random token transcripts (about 4 tokens/s)."""

    def __init__(self, num_utts, sample_rate, min_seconds, max_seconds, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(int(min_seconds * sample_rate), int(max_seconds * sample_rate) + 1,
                                     (num_utts,), generator=g).tolist()
        self.sample_rate = sample_rate
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed * 100003 + idx)
        n = self.lengths[idx]
        waveform = 0.1 * torch.randn(n, generator=g)
        n_tokens = max(1, int(4 * n / self.sample_rate))
        tokens = torch.randint(1, self.vocab_size, (n_tokens,), generator=g)
        return waveform, tokens


def collate_fn(batch):
    waveforms, tokens = zip(*batch)
    wav_lens = torch.tensor([w.shape[0] for w in waveforms], dtype=torch.long)
    tok_lens = torch.tensor([t.shape[0] for t in tokens], dtype=torch.long)
    wavs = torch.zeros(len(batch), int(wav_lens.max()))
    targets = torch.zeros(len(batch), int(tok_lens.max()), dtype=torch.long)
    for i, (w, t) in enumerate(zip(waveforms, tokens)):
        wavs[i, : w.shape[0]] = w
        targets[i, : t.shape[0]] = t
    return wavs, wav_lens, targets, tok_lens


# ----------------------------------------------------------------------------- features

def hz_to_mel(f):
    return 2595.0 * math.log10(1.0 + f / 700.0)


def melscale_fbanks(n_freqs, f_min, f_max, n_mels, sample_rate):
    """torchaudio.functional.melscale_fbanks (htk scale, no norm): (n_freqs, n_mels)."""
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    m_pts = torch.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2)
    f_pts = 700.0 * (10 ** (m_pts / 2595.0) - 1.0)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down_slopes = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up_slopes = slopes[:, 2:] / f_diff[1:]
    return torch.max(torch.zeros(1), torch.min(down_slopes, up_slopes))


class LogMelFrontend(nn.Module):
    """MelSpectrogram + log + per-utterance mean/variance normalisation; no parameters, runs on the GPU."""

    def __init__(self, sample_rate, n_fft, hop_length, n_mels):
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("fbank", melscale_fbanks(n_fft // 2 + 1, 0.0, sample_rate / 2, n_mels, sample_rate),
                             persistent=False)

    @torch.no_grad()
    def forward(self, wavs, wav_lens):
        spec = torch.stft(wavs, self.n_fft, hop_length=self.hop_length, window=self.window,
                          center=True, return_complex=True)            # (B, F, T)
        power = spec.abs().pow(2.0)
        mel = torch.matmul(power.transpose(1, 2), self.fbank)          # (B, T, n_mels)
        feats = torch.log(mel + 1e-6)
        feat_lens = wav_lens // self.hop_length + 1
        mask = torch.arange(feats.size(1), device=feats.device)[None, :] < feat_lens[:, None]
        denom = feat_lens[:, None].to(feats.dtype)
        mean = (feats * mask[..., None]).sum(1, keepdim=True) / denom[..., None]
        var = ((feats - mean).pow(2) * mask[..., None]).sum(1, keepdim=True) / denom[..., None]
        feats = (feats - mean) / torch.sqrt(var + 1e-5)
        feats = feats.masked_fill(~mask[..., None], 0.0)
        return feats, feat_lens


# ----------------------------------------------------------------------------- model

def _lengths_to_padding_mask(lengths):
    batch_size = lengths.shape[0]
    max_length = int(torch.max(lengths).item())
    padding_mask = torch.arange(max_length, device=lengths.device, dtype=lengths.dtype).expand(
        batch_size, max_length
    ) >= lengths.unsqueeze(1)
    return padding_mask


class Conv2dSubsampling(nn.Module):
    """4x time reduction (ESPnet Conv2dSubsampling)."""

    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2),
            nn.ReLU(),
            nn.Conv2d(odim, odim, 3, 2),
            nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lengths):
        x = x.unsqueeze(1)  # (B, 1, T, idim)
        x = self.conv(x)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        return x, lengths


class _ConvolutionModule(nn.Module):
    def __init__(self, input_dim, num_channels, depthwise_kernel_size, dropout=0.0, bias=False):
        super().__init__()
        if (depthwise_kernel_size - 1) % 2 != 0:
            raise ValueError("depthwise_kernel_size must be odd to achieve 'SAME' padding.")
        self.layer_norm = nn.LayerNorm(input_dim)
        self.sequential = nn.Sequential(
            nn.Conv1d(input_dim, 2 * num_channels, 1, stride=1, padding=0, bias=bias),
            nn.GLU(dim=1),
            nn.Conv1d(num_channels, num_channels, depthwise_kernel_size, stride=1,
                      padding=(depthwise_kernel_size - 1) // 2, groups=num_channels, bias=bias),
            nn.BatchNorm1d(num_channels),
            nn.SiLU(),
            nn.Conv1d(num_channels, input_dim, kernel_size=1, stride=1, padding=0, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, input):
        x = self.layer_norm(input)
        x = x.transpose(1, 2)
        x = self.sequential(x)
        return x.transpose(1, 2)


class _FeedForwardModule(nn.Module):
    def __init__(self, input_dim, hidden_dim, dropout=0.0):
        super().__init__()
        self.sequential = nn.Sequential(
            nn.LayerNorm(input_dim),
            nn.Linear(input_dim, hidden_dim, bias=True),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, input_dim, bias=True),
            nn.Dropout(dropout),
        )

    def forward(self, input):
        return self.sequential(input)


class ConformerLayer(nn.Module):
    def __init__(self, input_dim, ffn_dim, num_attention_heads, depthwise_conv_kernel_size, dropout=0.0):
        super().__init__()
        self.ffn1 = _FeedForwardModule(input_dim, ffn_dim, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(input_dim)
        self.self_attn = nn.MultiheadAttention(input_dim, num_attention_heads, dropout=dropout)
        self.self_attn_dropout = nn.Dropout(dropout)
        self.conv_module = _ConvolutionModule(input_dim, input_dim, depthwise_conv_kernel_size, dropout=dropout)
        self.ffn2 = _FeedForwardModule(input_dim, ffn_dim, dropout=dropout)
        self.final_layer_norm = nn.LayerNorm(input_dim)

    def _apply_convolution(self, input):
        residual = input
        input = input.transpose(0, 1)
        input = self.conv_module(input)
        input = input.transpose(0, 1)
        return residual + input

    def forward(self, input, key_padding_mask):
        # input: (T, B, D)
        residual = input
        x = self.ffn1(input)
        x = x * 0.5 + residual

        residual = x
        x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=key_padding_mask, need_weights=False)
        x = self.self_attn_dropout(x)
        x = x + residual

        x = self._apply_convolution(x)

        residual = x
        x = self.ffn2(x)
        x = x * 0.5 + residual

        x = self.final_layer_norm(x)
        return x


class Conformer(nn.Module):
    def __init__(self, input_dim, num_heads, ffn_dim, num_layers, depthwise_conv_kernel_size, dropout=0.0):
        super().__init__()
        self.conformer_layers = nn.ModuleList(
            [ConformerLayer(input_dim, ffn_dim, num_heads, depthwise_conv_kernel_size, dropout=dropout)
             for _ in range(num_layers)]
        )

    def forward(self, input, lengths):
        encoder_padding_mask = _lengths_to_padding_mask(lengths)
        x = input.transpose(0, 1)
        for layer in self.conformer_layers:
            x = layer(x, encoder_padding_mask)
        return x.transpose(0, 1), lengths


class ConformerCTC(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.subsampling = Conv2dSubsampling(args.n_mels, args.d_model)
        self.input_dropout = nn.Dropout(args.dropout)
        self.encoder = Conformer(args.d_model, args.num_heads, args.ffn_dim, args.num_layers,
                                 args.kernel_size, dropout=args.dropout)
        self.ctc_proj = nn.Linear(args.d_model, args.vocab_size)

    def forward(self, feats, feat_lens):
        x, lengths = self.subsampling(feats, feat_lens)
        x = self.input_dropout(x)
        x, lengths = self.encoder(x, lengths)
        return self.ctc_proj(x), lengths


def noam_lambda(d_model, warmup_steps, factor):
    def fn(step):
        step = max(step, 1)
        return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)
    return fn


# ----------------------------------------------------------------------------- training

def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    dataset = SyntheticSpeech(args.batch_size * max(args.steps, 1) * 4, args.sample_rate, args.min_seconds,
                              args.max_seconds, args.vocab_size, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                        pin_memory=True, collate_fn=collate_fn, drop_last=True, persistent_workers=False)

    frontend = LogMelFrontend(args.sample_rate, args.n_fft, args.hop_length, args.n_mels).to(device)
    model = ConformerCTC(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ConformerCTC: {n_params / 1e6:.2f}M parameters")

    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(args.d_model, args.warmup_steps,
                                                                        args.lr_factor))

    model.train()
    step = 0
    t0 = time.time()
    while step < args.steps:
        for wavs, wav_lens, targets, target_lens in loader:
            wavs = wavs.cuda(non_blocking=True)
            wav_lens = wav_lens.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            target_lens = target_lens.cuda(non_blocking=True)

            feats, feat_lens = frontend(wavs, wav_lens)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits, out_lens = model(feats, feat_lens)
                log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)  # (T, B, V)
                loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=0,
                                  reduction="mean", zero_infinity=True)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_interval == 0:
                print(f"step {step} | loss {loss.item():.3f} | grad norm {grad_norm.item():.2f} | "
                      f"lr {scheduler.get_last_lr()[0]:.2e} | frames {int(feat_lens.max())} | "
                      f"{(time.time() - t0) / step:.2f} s/step")
            if step >= args.steps:
                break
    print(f"max memory allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
