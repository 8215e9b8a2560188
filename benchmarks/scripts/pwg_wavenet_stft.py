"""Parallel WaveGAN generator pre-training (kan-bayashi/ParallelWaveGAN habit: the WaveNet-like non-causal generator trained alone with the multi-resolution STFT loss before the discriminator starts): gated dilated Conv1d residual blocks with mel conditioning through a Stretch2d/Conv2d upsample net, torch.nn.utils.parametrizations.weight_norm on every conv, the forward under torch.nn.utils.parametrize.cached(), register_full_backward_hook on a few modules logging grad norms into a list via .item(), MultiResolutionSTFTLoss (spectral convergence + log magnitude) with torch.stft(return_complex=True) and a per-device torch.hann_window, HiFi-GAN's Adam(betas=(0.8, 0.99)) + ExponentialLR, clip_grad_norm_."""

import argparse
import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

logging.basicConfig(level=logging.INFO, format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")


# ----------------------------------------------------------------------------------------------
# layers (parallel_wavegan/layers/residual_block.py, upsample.py)
# ----------------------------------------------------------------------------------------------
class Conv1d(torch.nn.Conv1d):
    """Conv1d module with customized initialization."""

    def __init__(self, *args, **kwargs):
        super(Conv1d, self).__init__(*args, **kwargs)

    def reset_parameters(self):
        torch.nn.init.kaiming_normal_(self.weight, nonlinearity="relu")
        if self.bias is not None:
            torch.nn.init.constant_(self.bias, 0.0)


class Conv1d1x1(Conv1d):
    """1x1 Conv1d with customized initialization."""

    def __init__(self, in_channels, out_channels, bias):
        super(Conv1d1x1, self).__init__(in_channels, out_channels, kernel_size=1, padding=0, dilation=1, bias=bias)


class ResidualBlock(torch.nn.Module):
    """Residual block module in WaveNet."""

    def __init__(self, kernel_size=3, residual_channels=64, gate_channels=128, skip_channels=64,
                 aux_channels=80, dropout=0.0, dilation=1, bias=True):
        super(ResidualBlock, self).__init__()
        self.dropout = dropout
        assert (kernel_size - 1) % 2 == 0, "Not support even number kernel size."
        padding = (kernel_size - 1) // 2 * dilation
        self.conv = Conv1d(residual_channels, gate_channels, kernel_size, padding=padding, dilation=dilation, bias=bias)
        if aux_channels > 0:
            self.conv1x1_aux = Conv1d1x1(aux_channels, gate_channels, bias=False)
        else:
            self.conv1x1_aux = None
        gate_out_channels = gate_channels // 2
        self.conv1x1_out = Conv1d1x1(gate_out_channels, residual_channels, bias=bias)
        self.conv1x1_skip = Conv1d1x1(gate_out_channels, skip_channels, bias=bias)

    def forward(self, x, c):
        residual = x
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = self.conv(x)

        # split into two part for gated activation
        splitdim = 1
        xa, xb = x.split(x.size(splitdim) // 2, dim=splitdim)

        # local conditioning
        if c is not None:
            assert self.conv1x1_aux is not None
            c = self.conv1x1_aux(c)
            ca, cb = c.split(c.size(splitdim) // 2, dim=splitdim)
            xa, xb = xa + ca, xb + cb

        x = torch.tanh(xa) * torch.sigmoid(xb)

        # for skip connection
        s = self.conv1x1_skip(x)

        # for residual connection
        x = (self.conv1x1_out(x) + residual) * math.sqrt(0.5)

        return x, s


class Stretch2d(torch.nn.Module):
    def __init__(self, x_scale, y_scale, mode="nearest"):
        super(Stretch2d, self).__init__()
        self.x_scale = x_scale
        self.y_scale = y_scale
        self.mode = mode

    def forward(self, x):
        return F.interpolate(x, scale_factor=(self.y_scale, self.x_scale), mode=self.mode)


class Conv2d(torch.nn.Conv2d):
    def __init__(self, *args, **kwargs):
        super(Conv2d, self).__init__(*args, **kwargs)

    def reset_parameters(self):
        self.weight.data.fill_(1.0 / np.prod(self.kernel_size))
        if self.bias is not None:
            torch.nn.init.constant_(self.bias, 0.0)


class UpsampleNetwork(torch.nn.Module):
    def __init__(self, upsample_scales, nonlinear_activation=None, nonlinear_activation_params={},
                 interpolate_mode="nearest", freq_axis_kernel_size=1):
        super(UpsampleNetwork, self).__init__()
        self.up_layers = torch.nn.ModuleList()
        for scale in upsample_scales:
            stretch = Stretch2d(scale, 1, interpolate_mode)
            self.up_layers += [stretch]
            assert (freq_axis_kernel_size - 1) % 2 == 0, "Not support even number freq axis kernel size."
            freq_axis_padding = (freq_axis_kernel_size - 1) // 2
            kernel_size = (freq_axis_kernel_size, scale * 2 + 1)
            padding = (freq_axis_padding, scale)
            conv = Conv2d(1, 1, kernel_size=kernel_size, padding=padding, bias=False)
            self.up_layers += [conv]
            if nonlinear_activation is not None:
                nonlinear = getattr(torch.nn, nonlinear_activation)(**nonlinear_activation_params)
                self.up_layers += [nonlinear]

    def forward(self, c):
        c = c.unsqueeze(1)  # (B, 1, C, T)
        for f in self.up_layers:
            c = f(c)
        return c.squeeze(1)  # (B, C, T')


class ConvInUpsampleNetwork(torch.nn.Module):
    def __init__(self, upsample_scales, nonlinear_activation=None, nonlinear_activation_params={},
                 interpolate_mode="nearest", freq_axis_kernel_size=1, aux_channels=80, aux_context_window=0):
        super(ConvInUpsampleNetwork, self).__init__()
        self.aux_context_window = aux_context_window
        kernel_size = 2 * aux_context_window + 1
        self.conv_in = Conv1d(aux_channels, aux_channels, kernel_size=kernel_size, bias=False)
        self.upsample = UpsampleNetwork(
            upsample_scales=upsample_scales,
            nonlinear_activation=nonlinear_activation,
            nonlinear_activation_params=nonlinear_activation_params,
            interpolate_mode=interpolate_mode,
            freq_axis_kernel_size=freq_axis_kernel_size,
        )

    def forward(self, c):
        c_ = self.conv_in(c)
        return self.upsample(c_)


# ----------------------------------------------------------------------------------------------
# generator (parallel_wavegan/models/parallel_wavegan.py)
# ----------------------------------------------------------------------------------------------
class ParallelWaveGANGenerator(torch.nn.Module):
    """Parallel WaveGAN Generator module."""

    def __init__(self, in_channels=1, out_channels=1, kernel_size=3, layers=30, stacks=3,
                 residual_channels=64, gate_channels=128, skip_channels=64, aux_channels=80,
                 aux_context_window=2, dropout=0.0, bias=True, use_weight_norm=True,
                 upsample_conditional_features=True, upsample_params={"upsample_scales": [4, 4, 4, 4]}):
        super(ParallelWaveGANGenerator, self).__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.aux_channels = aux_channels
        self.aux_context_window = aux_context_window
        self.layers = layers
        self.stacks = stacks
        self.kernel_size = kernel_size

        # check the number of layers and stacks
        assert layers % stacks == 0
        layers_per_stack = layers // stacks

        # define first convolution
        self.first_conv = Conv1d1x1(in_channels, residual_channels, bias=True)

        # define conv + upsampling network
        if upsample_conditional_features:
            upsample_params = dict(upsample_params)
            upsample_params.update({"aux_channels": aux_channels, "aux_context_window": aux_context_window})
            self.upsample_net = ConvInUpsampleNetwork(**upsample_params)
            self.upsample_factor = int(np.prod(upsample_params["upsample_scales"]))
        else:
            self.upsample_net = None
            self.upsample_factor = 1

        # define residual blocks
        self.conv_layers = torch.nn.ModuleList()
        for layer in range(layers):
            dilation = 2 ** (layer % layers_per_stack)
            conv = ResidualBlock(
                kernel_size=kernel_size,
                residual_channels=residual_channels,
                gate_channels=gate_channels,
                skip_channels=skip_channels,
                aux_channels=aux_channels,
                dilation=dilation,
                dropout=dropout,
                bias=bias,
            )
            self.conv_layers += [conv]

        # define output layers
        self.last_conv_layers = torch.nn.ModuleList([
            torch.nn.ReLU(inplace=True),
            Conv1d1x1(skip_channels, skip_channels, bias=True),
            torch.nn.ReLU(inplace=True),
            Conv1d1x1(skip_channels, out_channels, bias=True),
        ])

        # apply weight norm
        if use_weight_norm:
            self.apply_weight_norm()

    def forward(self, z, c):
        """
        Args:
            z (Tensor): Input noise signal (B, 1, T).
            c (Tensor): Local conditioning auxiliary features (B, C ,T').
        Returns:
            Tensor: Output tensor (B, out_channels, T)
        """
        # perform upsampling
        if c is not None and self.upsample_net is not None:
            c = self.upsample_net(c)
            assert c.size(-1) == z.size(-1)

        # encode to hidden representation
        x = self.first_conv(z)
        skips = 0
        for f in self.conv_layers:
            x, h = f(x, c)
            skips += h
        skips *= math.sqrt(1.0 / len(self.conv_layers))

        # apply final layers
        x = skips
        for f in self.last_conv_layers:
            x = f(x)

        return x

    def apply_weight_norm(self):
        """Apply weight normalization module from all of the layers."""

        def _apply_weight_norm(m):
            if isinstance(m, torch.nn.Conv1d) or isinstance(m, torch.nn.Conv2d):
                weight_norm(m)
                logging.debug(f"Weight norm is applied to {m}.")

        self.apply(_apply_weight_norm)

    def remove_weight_norm(self):
        def _remove_weight_norm(m):
            try:
                logging.debug(f"Weight norm is removed from {m}.")
                parametrize.remove_parametrizations(m, "weight")
            except ValueError:  # this module didn't have weight norm
                return

        self.apply(_remove_weight_norm)


# ----------------------------------------------------------------------------------------------
# losses (parallel_wavegan/losses/stft_loss.py)
# ----------------------------------------------------------------------------------------------
hann_window = {}


def stft(x, fft_size, hop_size, win_length):
    """Perform STFT and convert to magnitude spectrogram.

    Returns:
        Tensor: Magnitude spectrogram (B, #frames, fft_size // 2 + 1).
    """
    key = str(win_length) + "_" + str(x.device)
    if key not in hann_window:
        hann_window[key] = torch.hann_window(win_length, device=x.device)
    x_stft = torch.stft(x, fft_size, hop_size, win_length, hann_window[key], return_complex=True)
    real = x_stft.real
    imag = x_stft.imag

    # NOTE(kan-bayashi): clamp is needed to avoid nan or inf
    return torch.sqrt(torch.clamp(real ** 2 + imag ** 2, min=1e-7)).transpose(2, 1)


class SpectralConvergenceLoss(torch.nn.Module):
    def forward(self, x_mag, y_mag):
        return torch.norm(y_mag - x_mag, p="fro") / torch.norm(y_mag, p="fro")


class LogSTFTMagnitudeLoss(torch.nn.Module):
    def forward(self, x_mag, y_mag):
        return F.l1_loss(torch.log(y_mag), torch.log(x_mag))


class STFTLoss(torch.nn.Module):
    def __init__(self, fft_size=1024, shift_size=120, win_length=600):
        super(STFTLoss, self).__init__()
        self.fft_size = fft_size
        self.shift_size = shift_size
        self.win_length = win_length
        self.spectral_convergence_loss = SpectralConvergenceLoss()
        self.log_stft_magnitude_loss = LogSTFTMagnitudeLoss()

    def forward(self, x, y):
        x_mag = stft(x, self.fft_size, self.shift_size, self.win_length)
        y_mag = stft(y, self.fft_size, self.shift_size, self.win_length)
        sc_loss = self.spectral_convergence_loss(x_mag, y_mag)
        mag_loss = self.log_stft_magnitude_loss(x_mag, y_mag)
        return sc_loss, mag_loss


class MultiResolutionSTFTLoss(torch.nn.Module):
    def __init__(self, fft_sizes=[1024, 2048, 512], hop_sizes=[120, 240, 50], win_lengths=[600, 1200, 240]):
        super(MultiResolutionSTFTLoss, self).__init__()
        assert len(fft_sizes) == len(hop_sizes) == len(win_lengths)
        self.stft_losses = torch.nn.ModuleList()
        for fs, ss, wl in zip(fft_sizes, hop_sizes, win_lengths):
            self.stft_losses += [STFTLoss(fs, ss, wl)]

    def forward(self, x, y):
        if len(x.shape) == 3:
            x = x.view(-1, x.size(2))  # (B, C, T) -> (B x C, T)
            y = y.view(-1, y.size(2))  # (B, C, T) -> (B x C, T)
        sc_loss = 0.0
        mag_loss = 0.0
        for f in self.stft_losses:
            sc_l, mag_l = f(x, y)
            sc_loss += sc_l
            mag_loss += mag_l
        sc_loss /= len(self.stft_losses)
        mag_loss /= len(self.stft_losses)
        return sc_loss, mag_loss


# ----------------------------------------------------------------------------------------------
# data: synthetic (audio, mel) pairs cut like the Collater (batch_max_steps, aux_context_window)
# ----------------------------------------------------------------------------------------------
class SyntheticCollater(object):
    def __init__(self, batch_max_steps, hop_size, aux_context_window, num_mels, sampling_rate=24000):
        self.batch_max_steps = batch_max_steps
        self.hop_size = hop_size
        self.aux_context_window = aux_context_window
        self.num_mels = num_mels
        self.sampling_rate = sampling_rate
        self.batch_max_frames = batch_max_steps // hop_size

    def __call__(self, batch_size):
        # a fake utterance per item: a few sinusoids + noise, and a random log-mel of matching length
        frames = self.batch_max_frames + 2 * self.aux_context_window
        t = np.arange(self.batch_max_steps) / self.sampling_rate
        xs, cs = [], []
        for _ in range(batch_size):
            f0 = np.random.uniform(80, 400)
            x = sum(0.3 / k * np.sin(2 * np.pi * k * f0 * t + np.random.rand()) for k in range(1, 6))
            x = x + 0.01 * np.random.randn(len(t))
            xs.append(x.astype(np.float32))
            cs.append(np.random.randn(frames, self.num_mels).astype(np.float32))
        y_batch = torch.tensor(np.stack(xs)).unsqueeze(1)  # (B, 1, T)
        c_batch = torch.tensor(np.stack(cs)).transpose(2, 1)  # (B, C, T')
        z_batch = torch.randn(y_batch.size())  # (B, 1, T)
        return (z_batch, c_batch), y_batch


def main():
    parser = argparse.ArgumentParser(description="Train Parallel WaveGAN generator (STFT-loss warm-up stage).")
    parser.add_argument("--steps", type=int, default=10, help="number of training steps")
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--batch-max-steps", type=int, default=25600)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--stacks", type=int, default=3)
    parser.add_argument("--residual-channels", type=int, default=64)
    parser.add_argument("--gate-channels", type=int, default=128)
    parser.add_argument("--skip-channels", type=int, default=64)
    parser.add_argument("--num-mels", type=int, default=80)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--lr-decay", type=float, default=0.999)
    parser.add_argument("--grad-norm", type=float, default=10.0)
    parser.add_argument("--log-interval-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    upsample_scales = [4, 4, 4, 4]
    hop_size = int(np.prod(upsample_scales))
    aux_context_window = 2
    assert args.batch_max_steps % hop_size == 0

    model = ParallelWaveGANGenerator(
        layers=args.layers, stacks=args.stacks, residual_channels=args.residual_channels,
        gate_channels=args.gate_channels, skip_channels=args.skip_channels, aux_channels=args.num_mels,
        aux_context_window=aux_context_window, upsample_params={"upsample_scales": upsample_scales},
    ).to(device)
    logging.info(f"Generator parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    criterion = MultiResolutionSTFTLoss().to(device)

    # gradient-norm monitoring, the way people wire it up to spot exploding blocks
    grad_norm_log = []

    def log_grad_norm(name):
        def hook(module, grad_input, grad_output):
            g = grad_output[0]
            if g is not None:
                grad_norm_log.append((name, g.norm().item()))
        return hook

    model.first_conv.register_full_backward_hook(log_grad_norm("first_conv"))
    for i in range(0, len(model.conv_layers), max(1, len(model.conv_layers) // 3)):
        model.conv_layers[i].register_full_backward_hook(log_grad_norm(f"conv_layers.{i}"))
    model.last_conv_layers[-1].register_full_backward_hook(log_grad_norm("last_conv"))

    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, betas=(0.8, 0.99), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=args.lr_decay)

    collater = SyntheticCollater(args.batch_max_steps, hop_size, aux_context_window, args.num_mels)
    total_train_loss = {}
    model.train()
    start = time.time()
    for steps in range(1, args.steps + 1):
        x, y = collater(args.batch_size)
        x = tuple([x_.to(device, non_blocking=True) for x_ in x])
        y = y.to(device, non_blocking=True)

        # the weights are recomputed from (g, v) once per forward instead of once per access
        with parametrize.cached():
            y_ = model(*x)

        sc_loss, mag_loss = criterion(y_.squeeze(1), y.squeeze(1))
        gen_loss = sc_loss + mag_loss

        optimizer.zero_grad()
        gen_loss.backward()
        if args.grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_norm)
        optimizer.step()
        scheduler.step()

        for k, v in (("train/spectral_convergence_loss", sc_loss), ("train/log_stft_magnitude_loss", mag_loss),
                     ("train/generator_loss", gen_loss)):
            total_train_loss[k] = total_train_loss.get(k, 0.0) + v.item()

        if steps % args.log_interval_steps == 0:
            msg = f"(Steps: {steps}) "
            for k, v in total_train_loss.items():
                msg += f"{k} = {v / args.log_interval_steps:.4f}, "
            recent = ", ".join(f"{n}={g:.3e}" for n, g in grad_norm_log[-5:])
            logging.info(msg + f"lr = {scheduler.get_last_lr()[0]:.2e}, grad norms: {recent}")
            total_train_loss = {}

    torch.cuda.synchronize()
    logging.info(f"Finished {args.steps} steps in {time.time() - start:.1f}s; "
                 f"max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
                 f"{len(grad_norm_log)} gradient norms logged.")


if __name__ == "__main__":
    main()
