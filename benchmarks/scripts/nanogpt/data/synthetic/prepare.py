"""
Prepare a synthetic token dataset: uniformly random GPT-2 (padded) token ids.
Writes train.bin and val.bin in the same uint16 format as the openwebtext and
shakespeare datasets, so train.py reads them the same way.
"""
import os
import numpy as np

vocab_size = 50304 # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64
num_train_tokens = 10_000_000
num_val_tokens = 1_000_000

if __name__ == '__main__':
    rng = np.random.default_rng(1337)
    for split, n in [('train', num_train_tokens), ('val', num_val_tokens)]:
        ids = rng.integers(0, vocab_size, size=n, dtype=np.uint16)
        filename = os.path.join(os.path.dirname(__file__), f'{split}.bin')
        # write to a temp file first so a concurrent reader never sees a partial file
        tmp = f'{filename}.{os.getpid()}.tmp'
        ids.tofile(tmp)
        os.replace(tmp, filename)
        print(f"{split} has {n:,} tokens")

    # train.bin is ~20MB, val.bin ~2MB
