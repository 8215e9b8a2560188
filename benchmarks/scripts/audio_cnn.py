# Keyword-spotting style audio classifier: STFT -> log-mel (hand-made filterbank) -> SpecAugment
# -> Conv2d stack, plus a raw-waveform Conv1d branch and an rfft spectral feature.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda"
torch.backends.cudnn.benchmark = True

SR, N_FFT, HOP, N_MELS = 16000, 512, 160, 80
BATCH, SECONDS, N_CLASSES = 32, 4, 35
EPOCHS, STEPS_PER_EPOCH = 1, 8


def hz_to_mel(f):
    return 2595.0 * math.log10(1.0 + f / 700.0)


def mel_filterbank(n_fft, n_mels, sr, fmin=0.0, fmax=None):
    fmax = fmax or sr / 2
    n_freqs = n_fft // 2 + 1
    all_freqs = torch.linspace(0, sr // 2, n_freqs)
    m_pts = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    f_pts = 700.0 * (10 ** (m_pts / 2595.0) - 1.0)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = torch.clamp(torch.min(down, up), min=0.0)  # (n_freqs, n_mels)
    return fb


class LogMel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("fb", mel_filterbank(N_FFT, N_MELS, SR))

    def forward(self, wav):  # wav: (B, L)
        spec = torch.stft(wav, n_fft=N_FFT, hop_length=HOP, win_length=N_FFT,
                          window=self.window, center=True, return_complex=True)
        mag = spec.abs().pow(2.0)                      # (B, F, T)
        mel = torch.matmul(mag.transpose(1, 2), self.fb)  # (B, T, M)
        return torch.log(mel + 1e-6).transpose(1, 2)   # (B, M, T)


def spec_augment(x, n_freq_masks=2, F_=15, n_time_masks=2, T_=40):
    # x: (B, M, T); masks drawn per example on the GPU
    B, M, T = x.shape
    for _ in range(n_freq_masks):
        f = torch.randint(0, F_, (B, 1, 1), device=x.device)
        f0 = (torch.rand(B, 1, 1, device=x.device) * (M - f)).long()
        idx = torch.arange(M, device=x.device).view(1, M, 1)
        x = x.masked_fill((idx >= f0) & (idx < f0 + f), 0.0)
    for _ in range(n_time_masks):
        t = torch.randint(0, T_, (B, 1, 1), device=x.device)
        t0 = (torch.rand(B, 1, 1, device=x.device) * (T - t)).long()
        idx = torch.arange(T, device=x.device).view(1, 1, T)
        x = x.masked_fill((idx >= t0) & (idx < t0 + t), 0.0)
    return x


def conv_bn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU(inplace=True))


class AudioNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = LogMel()
        self.cnn = nn.Sequential(conv_bn(1, 32, 1), conv_bn(32, 64, 2), conv_bn(64, 128, 2),
                                 conv_bn(128, 256, 2), conv_bn(256, 256, 1))
        self.wave = nn.Sequential(
            nn.Conv1d(1, 64, 80, stride=4, padding=38), nn.BatchNorm1d(64), nn.ReLU(),
            nn.MaxPool1d(4), nn.Conv1d(64, 128, 3, padding=1), nn.BatchNorm1d(128), nn.ReLU(),
            nn.MaxPool1d(4), nn.Conv1d(128, 256, 3, padding=1), nn.BatchNorm1d(256), nn.ReLU())
        self.spec_proj = nn.Linear(257, 64)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(256 + 256 + 64, N_CLASSES))

    def forward(self, wav):
        feats = self.frontend(wav)
        if self.training:
            feats = spec_augment(feats)
        feats = (feats - feats.mean(dim=(1, 2), keepdim=True)) / (feats.std(dim=(1, 2), keepdim=True) + 1e-5)
        x = self.cnn(feats.unsqueeze(1))
        x = x.mean(dim=(2, 3))
        w = self.wave(wav.unsqueeze(1)).amax(dim=2)
        # global spectrum of 512-sample frames via rfft
        frames = wav.unfold(1, N_FFT, N_FFT)                    # (B, nfr, 512)
        spec = torch.fft.rfft(frames * self.frontend.window, dim=-1).abs()
        s = self.spec_proj(torch.log1p(spec).mean(dim=1))
        return self.head(torch.cat([x, w, s], dim=1))


model = AudioNet().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2, fused=True)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, epochs=EPOCHS,
                                                steps_per_epoch=STEPS_PER_EPOCH, pct_start=0.25)
print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

for epoch in range(EPOCHS):
    model.train()
    for step in range(STEPS_PER_EPOCH):
        wav = torch.randn(BATCH, SR * SECONDS, device=device) * 0.1
        labels = torch.randint(0, N_CLASSES, (BATCH,), device=device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(wav)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        scheduler.step()
        acc = (logits.argmax(1) == labels).float().mean()
        print(f"epoch {epoch} step {step} loss {loss.item():.4f} acc {acc.item():.3f} lr {scheduler.get_last_lr()[0]:.2e}")
