# HiFi-GAN (V1) vocoder training, jik876/hifi-gan train.py habits: a Conv1d /
# ConvTranspose1d generator with MRF residual blocks under weight norm (the newer
# parametrizations.weight_norm), multi-period (Conv2d over the waveform folded by period)
# and multi-scale discriminators (old-style weight_norm, spectral_norm on the first scale),
# LSGAN losses, feature matching, a 45x mel L1 loss through torch.stft with a Hann window on
# the GPU, two AdamW optimizers with ExponentialLR, a discriminator step then a generator
# step per iteration, an EMA of the generator (AveragedModel + get_ema_multi_avg_fn), and
# clip_grad_norm_(foreach=True).
#
#   python hifigan_gan.py                      # batch 16 x 8192 samples on cuda
#   python hifigan_gan.py --tiny --device cpu  # a quick check
import argparse
import itertools
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import AvgPool1d, Conv1d, Conv2d, ConvTranspose1d
from torch.nn.utils import spectral_norm, weight_norm
from torch.nn.utils.parametrizations import weight_norm as pweight_norm
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

LRELU_SLOPE = 0.1


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


V1 = AttrDict(
    resblock_kernel_sizes=[3, 7, 11],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    upsample_rates=[8, 8, 2, 2],
    upsample_kernel_sizes=[16, 16, 4, 4],
    upsample_initial_channel=512,
    segment_size=8192,
    num_mels=80,
    n_fft=1024,
    hop_size=256,
    win_size=1024,
    sampling_rate=22050,
    fmin=0,
    fmax=8000,
    fmax_for_loss=None,
    learning_rate=0.0002,
    adam_b1=0.8,
    adam_b2=0.99,
    lr_decay=0.999,
)


def init_weights(m, mean=0.0, std=0.01):
    if m.__class__.__name__.find("Conv") != -1:
        w = m.parametrizations.weight.original1 if hasattr(m, "parametrizations") else m.weight
        w.data.normal_(mean, std)


def get_padding(kernel_size, dilation=1):
    return int((kernel_size * dilation - dilation) / 2)


class ResBlock1(nn.Module):
    def __init__(self, channels, kernel_size=3, dilation=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList(
            pweight_norm(Conv1d(channels, channels, kernel_size, 1, dilation=d, padding=get_padding(kernel_size, d)))
            for d in dilation)
        self.convs1.apply(init_weights)
        self.convs2 = nn.ModuleList(
            pweight_norm(Conv1d(channels, channels, kernel_size, 1, dilation=1, padding=get_padding(kernel_size, 1)))
            for _ in dilation)
        self.convs2.apply(init_weights)

    def forward(self, x):
        for c1, c2 in zip(self.convs1, self.convs2):
            xt = F.leaky_relu(x, LRELU_SLOPE)
            xt = c1(xt)
            xt = F.leaky_relu(xt, LRELU_SLOPE)
            xt = c2(xt)
            x = xt + x
        return x


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.num_kernels = len(h.resblock_kernel_sizes)
        self.num_upsamples = len(h.upsample_rates)
        self.conv_pre = pweight_norm(Conv1d(h.num_mels, h.upsample_initial_channel, 7, 1, padding=3))
        self.ups = nn.ModuleList()
        for i, (u, k) in enumerate(zip(h.upsample_rates, h.upsample_kernel_sizes)):
            self.ups.append(pweight_norm(ConvTranspose1d(
                h.upsample_initial_channel // (2 ** i), h.upsample_initial_channel // (2 ** (i + 1)),
                k, u, padding=(k - u) // 2)))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            ch = h.upsample_initial_channel // (2 ** (i + 1))
            for k, d in zip(h.resblock_kernel_sizes, h.resblock_dilation_sizes):
                self.resblocks.append(ResBlock1(ch, k, d))
        self.conv_post = pweight_norm(Conv1d(ch, 1, 7, 1, padding=3))
        self.ups.apply(init_weights)
        self.conv_post.apply(init_weights)

    def forward(self, x):
        x = self.conv_pre(x)
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, LRELU_SLOPE)
            x = self.ups[i](x)
            xs = None
            for j in range(self.num_kernels):
                r = self.resblocks[i * self.num_kernels + j](x)
                xs = r if xs is None else xs + r
            x = xs / self.num_kernels
        x = F.leaky_relu(x)
        x = self.conv_post(x)
        return torch.tanh(x)


class DiscriminatorP(nn.Module):
    def __init__(self, period, kernel_size=5, stride=3):
        super().__init__()
        self.period = period
        pad = (get_padding(5, 1), 0)
        self.convs = nn.ModuleList([
            weight_norm(Conv2d(1, 32, (kernel_size, 1), (stride, 1), padding=pad)),
            weight_norm(Conv2d(32, 128, (kernel_size, 1), (stride, 1), padding=pad)),
            weight_norm(Conv2d(128, 512, (kernel_size, 1), (stride, 1), padding=pad)),
            weight_norm(Conv2d(512, 1024, (kernel_size, 1), (stride, 1), padding=pad)),
            weight_norm(Conv2d(1024, 1024, (kernel_size, 1), 1, padding=(2, 0))),
        ])
        self.conv_post = weight_norm(Conv2d(1024, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        fmap = []
        b, c, t = x.shape
        if t % self.period != 0:  # pad first
            n_pad = self.period - (t % self.period)
            x = F.pad(x, (0, n_pad), "reflect")
            t = t + n_pad
        x = x.view(b, c, t // self.period, self.period)
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList(DiscriminatorP(p) for p in (2, 3, 5, 7, 11))

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for d in self.discriminators:
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


class DiscriminatorS(nn.Module):
    def __init__(self, use_spectral_norm=False):
        super().__init__()
        norm_f = spectral_norm if use_spectral_norm else weight_norm
        self.convs = nn.ModuleList([
            norm_f(Conv1d(1, 128, 15, 1, padding=7)),
            norm_f(Conv1d(128, 128, 41, 2, groups=4, padding=20)),
            norm_f(Conv1d(128, 256, 41, 2, groups=16, padding=20)),
            norm_f(Conv1d(256, 512, 41, 4, groups=16, padding=20)),
            norm_f(Conv1d(512, 1024, 41, 4, groups=16, padding=20)),
            norm_f(Conv1d(1024, 1024, 41, 1, groups=16, padding=20)),
            norm_f(Conv1d(1024, 1024, 5, 1, padding=2)),
        ])
        self.conv_post = norm_f(Conv1d(1024, 1, 3, 1, padding=1))

    def forward(self, x):
        fmap = []
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class MultiScaleDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([
            DiscriminatorS(use_spectral_norm=True),
            DiscriminatorS(),
            DiscriminatorS(),
        ])
        self.meanpools = nn.ModuleList([AvgPool1d(4, 2, padding=2), AvgPool1d(4, 2, padding=2)])

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for i, d in enumerate(self.discriminators):
            if i != 0:
                y = self.meanpools[i - 1](y)
                y_hat = self.meanpools[i - 1](y_hat)
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r)
            fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g)
            fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl - gl))
    return loss * 2


def discriminator_loss(disc_real_outputs, disc_generated_outputs):
    loss = 0
    r_losses, g_losses = [], []
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        r_loss = torch.mean((1 - dr) ** 2)
        g_loss = torch.mean(dg ** 2)
        loss += r_loss + g_loss
        r_losses.append(r_loss.item())
        g_losses.append(g_loss.item())
    return loss, r_losses, g_losses


def generator_loss(disc_outputs):
    loss = 0
    gen_losses = []
    for dg in disc_outputs:
        l = torch.mean((1 - dg) ** 2)
        gen_losses.append(l)
        loss += l
    return loss, gen_losses


# -- mel spectrogram (meldataset.py), with a librosa-free Slaney-style filterbank --------------
def _hz_to_mel(f):
    f = torch.as_tensor(f, dtype=torch.float64)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return torch.where(f >= min_log_hz, min_log_mel + torch.log(f.clamp(min=1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz(m):
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), freqs)


def librosa_mel_fn(sr, n_fft, n_mels, fmin, fmax):
    fmax = sr / 2 if fmax is None else fmax  # librosa's default
    fftfreqs = torch.linspace(0, sr / 2, 1 + n_fft // 2, dtype=torch.float64)
    mel_f = _mel_to_hz(torch.linspace(float(_hz_to_mel(fmin)), float(_hz_to_mel(fmax)), n_mels + 2,
                                      dtype=torch.float64))
    fdiff = mel_f[1:] - mel_f[:-1]
    ramps = mel_f[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0)
    enorm = 2.0 / (mel_f[2:n_mels + 2] - mel_f[:n_mels])
    return (weights * enorm[:, None]).float()


mel_basis = {}
hann_window = {}


def dynamic_range_compression_torch(x, C=1, clip_val=1e-5):
    return torch.log(torch.clamp(x, min=clip_val) * C)


def mel_spectrogram(y, n_fft, num_mels, sampling_rate, hop_size, win_size, fmin, fmax, center=False):
    global mel_basis, hann_window
    key = f"{fmax}_{y.device}"
    if key not in mel_basis:
        mel_basis[key] = librosa_mel_fn(sampling_rate, n_fft, num_mels, fmin, fmax).to(y.device)
        hann_window[str(y.device)] = torch.hann_window(win_size).to(y.device)

    y = F.pad(y.unsqueeze(1), (int((n_fft - hop_size) / 2), int((n_fft - hop_size) / 2)), mode="reflect")
    y = y.squeeze(1)
    spec = torch.stft(y, n_fft, hop_length=hop_size, win_length=win_size, window=hann_window[str(y.device)],
                      center=center, pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    spec = torch.matmul(mel_basis[key], spec)
    return dynamic_range_compression_torch(spec)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--segment_size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="narrow generator and short segments (a CPU check)")
    parser.add_argument("--stdout_interval", type=int, default=1)
    a = parser.parse_args()

    h = AttrDict(V1)
    if a.tiny:
        h.upsample_initial_channel = 32
        a.batch_size, a.segment_size = 2, 4096
    h.segment_size = a.segment_size
    torch.manual_seed(1234)
    device = torch.device(a.device)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    ema_g = AveragedModel(generator, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    print(f"generator {sum(p.numel() for p in generator.parameters()) / 1e6:.2f}M, "
          f"mpd {sum(p.numel() for p in mpd.parameters()) / 1e6:.2f}M, "
          f"msd {sum(p.numel() for p in msd.parameters()) / 1e6:.2f}M params")

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()),
                                h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay)

    generator.train()
    mpd.train()
    msd.train()
    # A fixed set of host segments stands in for MelDataset (audio, its mel computed on the GPU).
    audio_bank = [torch.rand(a.batch_size, a.segment_size) * 1.6 - 0.8 for _ in range(2)]
    if device.type == "cuda":
        audio_bank = [t.pin_memory() for t in audio_bank]

    steps = 0
    for step in range(a.steps):
        start_b = time.time()
        y = audio_bank[step % len(audio_bank)].to(device, non_blocking=True)
        with torch.no_grad():
            x = mel_spectrogram(y, h.n_fft, h.num_mels, h.sampling_rate, h.hop_size, h.win_size, h.fmin, h.fmax)
            y_mel = mel_spectrogram(y, h.n_fft, h.num_mels, h.sampling_rate, h.hop_size, h.win_size, h.fmin,
                                    h.fmax_for_loss)
        y = y.unsqueeze(1)

        y_g_hat = generator(x)
        y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                      h.win_size, h.fmin, h.fmax_for_loss)

        optim_d.zero_grad()
        # MPD
        y_df_hat_r, y_df_hat_g, _, _ = mpd(y, y_g_hat.detach())
        loss_disc_f, losses_disc_f_r, losses_disc_f_g = discriminator_loss(y_df_hat_r, y_df_hat_g)
        # MSD
        y_ds_hat_r, y_ds_hat_g, _, _ = msd(y, y_g_hat.detach())
        loss_disc_s, losses_disc_s_r, losses_disc_s_g = discriminator_loss(y_ds_hat_r, y_ds_hat_g)
        loss_disc_all = loss_disc_s + loss_disc_f
        loss_disc_all.backward()
        d_norm = torch.nn.utils.clip_grad_norm_(itertools.chain(mpd.parameters(), msd.parameters()), 1000.0,
                                                foreach=True)
        optim_d.step()

        # Generator
        optim_g.zero_grad()
        loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
        y_df_hat_r, y_df_hat_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
        y_ds_hat_r, y_ds_hat_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
        loss_fm_f = feature_loss(fmap_f_r, fmap_f_g)
        loss_fm_s = feature_loss(fmap_s_r, fmap_s_g)
        loss_gen_f, losses_gen_f = generator_loss(y_df_hat_g)
        loss_gen_s, losses_gen_s = generator_loss(y_ds_hat_g)
        loss_gen_all = loss_gen_s + loss_gen_f + loss_fm_s + loss_fm_f + loss_mel
        loss_gen_all.backward()
        g_norm = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0, foreach=True)
        optim_g.step()
        ema_g.update_parameters(generator)

        if steps % a.stdout_interval == 0:
            with torch.no_grad():
                mel_error = F.l1_loss(y_mel, y_g_hat_mel).item()
            mem = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else ""
            print(f"Steps : {steps:d}, Gen Loss Total : {loss_gen_all:4.3f}, Disc Loss : {loss_disc_all:4.3f}, "
                  f"Mel-Spec. Error : {mel_error:4.3f}, |g| {g_norm:.2f} |d| {d_norm:.2f}, "
                  f"s/b : {time.time() - start_b:4.3f}{mem}")
        steps += 1
        scheduler_g.step()
        scheduler_d.step()


if __name__ == "__main__":
    main()
