# train a GPT-2 (124M) on synthetic tokens for a handful of iterations
# launch as the following:
# $ python train.py config/corpus.py

out_dir = 'out-corpus'
dataset = 'synthetic'

# 12 batch size * 1024 block size * 2 gradaccum = 24,576 tokens per iter
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 2

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0

max_iters = 6
lr_decay_iters = 6
warmup_iters = 2

eval_interval = 1000
eval_iters = 2
log_interval = 1

always_save_checkpoint = False
compile = False
