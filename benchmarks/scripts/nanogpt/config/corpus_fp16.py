# same as corpus.py, but with float16 autocast so the GradScaler is enabled
# $ python train.py config/corpus_fp16.py

out_dir = 'out-corpus-fp16'
dataset = 'synthetic'

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

dtype = 'float16'
scaler_api = 'amp'
