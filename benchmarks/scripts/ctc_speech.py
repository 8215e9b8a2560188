# End-to-end ASR (AssemblyAI "Building an end-to-end Speech Recognition model in PyTorch" style, no torchaudio):
# log-mel on the GPU, SpecAugment, ResCNN + BiGRU, CTC
import argparse
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data as data


class TextTransform:
    """Maps characters to integers and vice versa"""
    def __init__(self):
        char_map_str = """
        ' 0
        <SPACE> 1
        a 2
        b 3
        c 4
        d 5
        e 6
        f 7
        g 8
        h 9
        i 10
        j 11
        k 12
        l 13
        m 14
        n 15
        o 16
        p 17
        q 18
        r 19
        s 20
        t 21
        u 22
        v 23
        w 24
        x 25
        y 26
        z 27
        """
        self.char_map = {}
        self.index_map = {}
        for line in char_map_str.strip().split('\n'):
            ch, index = line.split()
            self.char_map[ch] = int(index)
            self.index_map[int(index)] = ch
        self.index_map[1] = ' '

    def text_to_int(self, text):
        """ Use a character map and convert text to an integer sequence """
        int_sequence = []
        for c in text:
            if c == ' ':
                ch = self.char_map['<SPACE>']
            else:
                ch = self.char_map[c]
            int_sequence.append(ch)
        return int_sequence

    def int_to_text(self, labels):
        """ Use a character map and convert integer labels to an text sequence """
        string = []
        for i in labels:
            string.append(self.index_map[i])
        return ''.join(string).replace('<SPACE>', ' ')


text_transform = TextTransform()


def mel_filterbank(sample_rate, n_fft, n_mels, f_min=0.0, f_max=None):
    """HTK-style triangular mel filterbank, (n_fft // 2 + 1, n_mels), built with numpy."""
    f_max = f_max or sample_rate / 2
    def hz_to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)
    def mel_to_hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    all_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    m_pts = np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2)
    f_pts = mel_to_hz(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts[None, :] - all_freqs[:, None]
    down_slopes = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up_slopes = slopes[:, 2:] / f_diff[1:]
    fb = np.maximum(0.0, np.minimum(down_slopes, up_slopes))
    return torch.from_numpy(fb).float()


class LogMelSpectrogram(nn.Module):
    """torchaudio.transforms.MelSpectrogram without torchaudio: runs wherever its buffer lives."""
    def __init__(self, sample_rate=16000, n_fft=400, hop_length=160, n_mels=128):
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.register_buffer("mel_fb", mel_filterbank(sample_rate, n_fft, n_mels))

    @torch.no_grad()
    def forward(self, waveform):
        # waveform: (batch, time)
        window = torch.hann_window(self.n_fft, device=waveform.device)
        spec = torch.stft(waveform, self.n_fft, hop_length=self.hop_length, window=window,
                          center=True, return_complex=True)
        spec = spec.abs().pow(2)                                          # (batch, freq, frames)
        mel = torch.matmul(spec.transpose(1, 2), self.mel_fb).transpose(1, 2)  # (batch, n_mels, frames)
        return torch.log(mel + 1e-6)


def spec_augment(spec, freq_mask_param=30, time_mask_param=100, n_masks=2):
    """FrequencyMasking + TimeMasking, one random slice per utterance and mask."""
    # spec: (batch, 1, n_mels, frames)
    for i in range(spec.size(0)):
        for _ in range(n_masks):
            f = random.randint(0, freq_mask_param)
            f0 = random.randint(0, spec.size(2) - f)
            spec[i, :, f0:f0 + f, :] = 0
            t = random.randint(0, time_mask_param)
            t0 = random.randint(0, spec.size(3) - t)
            spec[i, :, :, t0:t0 + t] = 0
    return spec


class SyntheticLibriSpeech(data.Dataset):
    """Stands in for torchaudio.datasets.LIBRISPEECH: (waveform, sample_rate, utterance, ...)"""
    def __init__(self, n_utterances, sample_rate=16000, min_seconds=4.0, max_seconds=15.0, seed=7):
        rng = np.random.RandomState(seed)
        self.sample_rate = sample_rate
        self.lengths = (rng.uniform(min_seconds, max_seconds, n_utterances) * sample_rate).astype(np.int64)
        letters = "abcdefghijklmnopqrstuvwxyz' "
        self.utterances = []
        for n in self.lengths:
            n_chars = int(n / sample_rate * 14)  # ~14 characters a second of speech
            self.utterances.append(''.join(rng.choice(list(letters), n_chars)).strip() or "a")

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, idx):
        waveform = torch.randn(1, int(self.lengths[idx])) * 0.1
        return waveform, self.sample_rate, self.utterances[idx], 0, 0, 0


def data_processing(data, hop_length=160):
    waveforms = []
    labels = []
    input_lengths = []
    label_lengths = []
    for (waveform, _, utterance, _, _, _) in data:
        waveforms.append(waveform.squeeze(0))
        label = torch.Tensor(text_transform.text_to_int(utterance.lower()))
        labels.append(label)
        input_lengths.append(waveform.shape[1] // hop_length + 1)
        label_lengths.append(len(label))

    waveforms = nn.utils.rnn.pad_sequence(waveforms, batch_first=True)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True)

    return waveforms, labels, input_lengths, label_lengths


class CNNLayerNorm(nn.Module):
    """Layer normalization built for cnns input"""
    def __init__(self, n_feats):
        super(CNNLayerNorm, self).__init__()
        self.layer_norm = nn.LayerNorm(n_feats)

    def forward(self, x):
        # x (batch, channel, feature, time)
        x = x.transpose(2, 3).contiguous()  # (batch, channel, time, feature)
        x = self.layer_norm(x)
        return x.transpose(2, 3).contiguous()  # (batch, channel, feature, time)


class ResidualCNN(nn.Module):
    """Residual CNN inspired by https://arxiv.org/pdf/1603.05027.pdf
        except with layer norm instead of batch norm
    """
    def __init__(self, in_channels, out_channels, kernel, stride, dropout, n_feats):
        super(ResidualCNN, self).__init__()

        self.cnn1 = nn.Conv2d(in_channels, out_channels, kernel, stride, padding=kernel//2)
        self.cnn2 = nn.Conv2d(out_channels, out_channels, kernel, stride, padding=kernel//2)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.layer_norm1 = CNNLayerNorm(n_feats)
        self.layer_norm2 = CNNLayerNorm(n_feats)

    def forward(self, x):
        residual = x  # (batch, channel, feature, time)
        x = self.layer_norm1(x)
        x = F.gelu(x)
        x = self.dropout1(x)
        x = self.cnn1(x)
        x = self.layer_norm2(x)
        x = F.gelu(x)
        x = self.dropout2(x)
        x = self.cnn2(x)
        x += residual
        return x  # (batch, channel, feature, time)


class BidirectionalGRU(nn.Module):

    def __init__(self, rnn_dim, hidden_size, dropout, batch_first):
        super(BidirectionalGRU, self).__init__()

        self.BiGRU = nn.GRU(
            input_size=rnn_dim, hidden_size=hidden_size,
            num_layers=1, batch_first=batch_first, bidirectional=True)
        self.layer_norm = nn.LayerNorm(rnn_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.layer_norm(x)
        x = F.gelu(x)
        x, _ = self.BiGRU(x)
        x = self.dropout(x)
        return x


class SpeechRecognitionModel(nn.Module):

    def __init__(self, n_cnn_layers, n_rnn_layers, rnn_dim, n_class, n_feats, stride=2, dropout=0.1):
        super(SpeechRecognitionModel, self).__init__()
        n_feats = n_feats//2
        self.cnn = nn.Conv2d(1, 32, 3, stride=stride, padding=3//2)  # cnn for extracting heirachal features

        # n residual cnn layers with filter size of 32
        self.rescnn_layers = nn.Sequential(*[
            ResidualCNN(32, 32, kernel=3, stride=1, dropout=dropout, n_feats=n_feats)
            for _ in range(n_cnn_layers)
        ])
        self.fully_connected = nn.Linear(n_feats*32, rnn_dim)
        self.birnn_layers = nn.Sequential(*[
            BidirectionalGRU(rnn_dim=rnn_dim if i==0 else rnn_dim*2,
                             hidden_size=rnn_dim, dropout=dropout, batch_first=i==0)
            for i in range(n_rnn_layers)
        ])
        self.classifier = nn.Sequential(
            nn.Linear(rnn_dim*2, rnn_dim),  # birnn returns rnn_dim*2
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(rnn_dim, n_class)
        )

    def forward(self, x):
        x = self.cnn(x)
        x = self.rescnn_layers(x)
        sizes = x.size()
        x = x.view(sizes[0], sizes[1] * sizes[2], sizes[3])  # (batch, feature, time)
        x = x.transpose(1, 2)  # (batch, time, feature)
        x = self.fully_connected(x)
        x = self.birnn_layers(x)
        x = self.classifier(x)
        return x


class IterMeter(object):
    """keeps track of total iterations"""
    def __init__(self):
        self.val = 0

    def step(self):
        self.val += 1

    def get(self):
        return self.val


def train(model, featurizer, device, train_loader, criterion, optimizer, scheduler, epoch, iter_meter, hparams):
    model.train()
    data_len = len(train_loader.dataset)
    start = time.time()
    for batch_idx, _data in enumerate(train_loader):
        waveforms, labels, input_lengths, label_lengths = _data
        waveforms, labels = waveforms.to(device, non_blocking=True), labels.to(device, non_blocking=True)

        # (batch, 1, n_mels, frames), computed on the GPU
        spectrograms = featurizer(waveforms).unsqueeze(1)
        spectrograms = spec_augment(spectrograms)
        # the conv front end halves time
        output_lengths = [l // hparams['stride'] for l in input_lengths]

        optimizer.zero_grad()

        output = model(spectrograms)  # (batch, time, n_class)
        output = F.log_softmax(output, dim=2)
        output = output.transpose(0, 1)  # (time, batch, n_class)

        loss = criterion(output, labels, output_lengths, label_lengths)
        loss.backward()

        torch.nn.utils.clip_grad_norm_(model.parameters(), hparams['grad_clip'])
        optimizer.step()
        scheduler.step()
        iter_meter.step()
        if batch_idx % 2 == 0 or batch_idx == data_len:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\tlr: {:.2e}\t{:.2f}s'.format(
                epoch, batch_idx * len(waveforms), data_len,
                100. * batch_idx / len(train_loader), loss.item(), scheduler.get_last_lr()[0],
                time.time() - start))


def main():
    parser = argparse.ArgumentParser(description='DeepSpeech2-ish CTC ASR')
    parser.add_argument('--learning-rate', type=float, default=5e-4)
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--steps-per-epoch', type=int, default=8, help='synthetic utterances = batch_size * this')
    parser.add_argument('--n-cnn-layers', type=int, default=3)
    parser.add_argument('--n-rnn-layers', type=int, default=5)
    parser.add_argument('--rnn-dim', type=int, default=512)
    parser.add_argument('--n-feats', type=int, default=128)
    parser.add_argument('--max-seconds', type=float, default=15.0)
    parser.add_argument('--dropout', type=float, default=0.1)
    parser.add_argument('--grad-clip', type=float, default=400.0)
    parser.add_argument('--seed', type=int, default=7)
    parser.add_argument('--device', default='cuda')
    args = parser.parse_args()

    hparams = {
        "n_cnn_layers": args.n_cnn_layers,
        "n_rnn_layers": args.n_rnn_layers,
        "rnn_dim": args.rnn_dim,
        "n_class": 29,
        "n_feats": args.n_feats,
        "stride": 2,
        "dropout": args.dropout,
        "learning_rate": args.learning_rate,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "grad_clip": args.grad_clip,
    }

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    use_cuda = args.device == 'cuda' and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")

    train_dataset = SyntheticLibriSpeech(args.batch_size * args.steps_per_epoch, max_seconds=args.max_seconds,
                                         seed=args.seed)
    kwargs = {'num_workers': 0, 'pin_memory': True} if use_cuda else {}
    train_loader = data.DataLoader(dataset=train_dataset,
                                   batch_size=hparams['batch_size'],
                                   shuffle=True,
                                   collate_fn=lambda x: data_processing(x),
                                   **kwargs)

    featurizer = LogMelSpectrogram(n_mels=hparams['n_feats']).to(device)
    model = SpeechRecognitionModel(
        hparams['n_cnn_layers'], hparams['n_rnn_layers'], hparams['rnn_dim'],
        hparams['n_class'], hparams['n_feats'], hparams['stride'], hparams['dropout']
    ).to(device)

    print(model)
    print('Num Model Parameters', sum([param.nelement() for param in model.parameters()]))

    optimizer = optim.AdamW(model.parameters(), hparams['learning_rate'])
    criterion = nn.CTCLoss(blank=28, zero_infinity=True).to(device)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, max_lr=hparams['learning_rate'],
                                              steps_per_epoch=int(len(train_loader)),
                                              epochs=hparams['epochs'],
                                              anneal_strategy='linear')

    iter_meter = IterMeter()
    for epoch in range(1, args.epochs + 1):
        train(model, featurizer, device, train_loader, criterion, optimizer, scheduler, epoch, iter_meter, hparams)
    if use_cuda:
        print('max memory allocated {:.2f} GiB, reserved {:.2f} GiB'.format(
            torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30))


if __name__ == '__main__':
    main()
