"""cuDNN's layouts on the GPU: the output's and both gradients' layouts of a 3 x 3 convolution.

    python3 benchmarks/conv_layout.py > benchmarks/results/conv-layout-h200.jsonl   # on the GPU

For fp32 and bf16, ordinary and depthwise, every pair of input and weight
layouts; one JSON line each. tests/test_cudnn.py checks the simulated GPU
against the file.
"""
import json, torch, torch.nn as nn
for dt in (torch.float32, torch.bfloat16):
    for xin in ("contiguous", "channels_last"):
        for win in ("contiguous", "channels_last"):
            for groups, cin in ((1, 64), (64, 64)):
                conv = nn.Conv2d(cin, 64, 3, padding=1, groups=groups).cuda().to(dt)
                if win == "channels_last": conv = conv.to(memory_format=torch.channels_last)
                x = torch.randn(8, cin, 32, 32, device="cuda", dtype=dt)
                if xin == "channels_last": x = x.contiguous(memory_format=torch.channels_last)
                x.requires_grad_(True)
                y = conv(x)
                y.backward(torch.ones_like(y))
                cl = lambda t: t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
                print(json.dumps({"dtype": str(dt), "input": xin, "weight": win, "groups": groups, "out_cl": cl(y),
                                  "grad_input_cl": cl(x.grad), "grad_weight_cl": cl(conv.weight.grad)}))
