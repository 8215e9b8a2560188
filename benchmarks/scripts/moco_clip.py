# CLIP-style image/text contrastive training with a MoCo-style momentum image encoder and queue.
import copy
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(42)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

BATCH, IMG, SEQ, VOCAB, DIM, QUEUE = 128, 160, 64, 49408, 256, 8192


class TextEncoder(nn.Module):
    def __init__(self, vocab, width=512, layers=4, heads=8, out_dim=DIM):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.01)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out_dim, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos
        causal = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        x = self.tf(x, mask=causal, is_causal=True)
        x = self.ln(x)
        eot = ids.argmax(dim=-1)  # EOT token has the largest id, as in CLIP
        x = x[torch.arange(x.size(0), device=x.device), eot]
        return self.proj(x)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), out_dim=DIM):
        super().__init__()
        self.inplanes = 64
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], 2)
        self.layer3 = self._make_layer(256, layers[2], 2)
        self.layer4 = self._make_layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(inplace=True), nn.Linear(2048, out_dim))

    def _make_layer(self, planes, blocks, stride=1):
        layers = [Bottleneck(self.inplanes, planes, stride)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def image_encoder():
    return ResNet()


class CLIPMoCo(nn.Module):
    def __init__(self, m=0.995):
        super().__init__()
        self.visual = image_encoder()
        self.text = TextEncoder(VOCAB)
        self.visual_k = copy.deepcopy(self.visual)
        for p in self.visual_k.parameters():
            p.requires_grad = False
        self.m = m
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.register_buffer("queue", F.normalize(torch.randn(QUEUE, DIM), dim=1))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update(self):
        for pq, pk in zip(self.visual.parameters(), self.visual_k.parameters()):
            pk.data.mul_(self.m).add_(pq.data, alpha=1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        bs = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert QUEUE % bs == 0
        self.queue[ptr:ptr + bs, :] = keys
        self.queue_ptr[0] = (ptr + bs) % QUEUE

    def forward(self, img_q, img_k, ids):
        img = F.normalize(self.visual(img_q), dim=-1)
        txt = F.normalize(self.text(ids), dim=-1)
        scale = self.logit_scale.exp()
        logits_per_image = img @ txt.T * scale
        logits_per_text = logits_per_image.t()
        labels = torch.arange(img.size(0), device=img.device)
        clip_loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2

        with torch.no_grad():
            self._momentum_update()
            k = F.normalize(self.visual_k(img_k), dim=-1)
        l_pos = torch.einsum("nc,nc->n", img, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,kc->nk", img, self.queue.clone().detach())
        moco_logits = torch.cat([l_pos, l_neg], dim=1) / 0.2
        moco_labels = torch.zeros(moco_logits.shape[0], dtype=torch.long, device=img.device)
        moco_loss = F.cross_entropy(moco_logits, moco_labels)
        self._dequeue_and_enqueue(k)
        return clip_loss + moco_loss, clip_loss, moco_loss


def exclude_from_wd(n, p):
    return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n


model = CLIPMoCo().to(device)
params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
optimizer = torch.optim.SGD([
    {"params": [p for n, p in params if not exclude_from_wd(n, p)], "weight_decay": 1e-4},
    {"params": [p for n, p in params if exclude_from_wd(n, p)], "weight_decay": 0.0},
], lr=0.03, momentum=0.9, nesterov=True)
scaler = torch.amp.GradScaler("cuda")

mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)

for step in range(8):
    imgs = torch.rand(BATCH, 3, IMG, IMG, device=device)
    img_q = (imgs - mean) / std
    img_k = (torch.flip(imgs, dims=[3]) - mean) / std        # "augmented" view
    ids = torch.randint(1, VOCAB - 1, (BATCH, SEQ), device=device)
    ids[:, -1] = VOCAB - 1
    with torch.autocast("cuda", dtype=torch.float16):
        loss, lc, lm = model(img_q, img_k, ids)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    print(f"step {step} loss {loss.item():.4f} clip {lc.item():.4f} moco {lm.item():.4f} "
          f"scale {model.logit_scale.exp().item():.2f}")
