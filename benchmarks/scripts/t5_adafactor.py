# Seq2seq fine-tuning in the style of HF examples without the Trainer: T5 with Adafactor, bf16 autocast.
import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.optimization import Adafactor
cfg = T5Config(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, decoder_start_token_id=0)
model = T5ForConditionalGeneration(cfg).cuda()
model.train()
opt = Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)
for step in range(5):
    src = torch.randint(0, 32128, (16, 512), device="cuda")
    tgt = torch.randint(0, 32128, (16, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_ids=src, attention_mask=torch.ones_like(src), labels=tgt)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, out.loss.item())
