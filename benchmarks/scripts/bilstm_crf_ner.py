"""BiLSTM-CRF named-entity tagger.

Imitates:
  * the PyTorch tutorial "Advanced: Making Dynamic Decisions and the Bi-LSTM CRF"
    (START/STOP tags, transitions[to, from], forward algorithm, Viterbi decode),
  * kaniblu/pytorch-bilstmcrf (word + char-CNN embeddings, pack_padded_sequence
    around a batch_first bidirectional LSTM, a batched CRF with masks),
  * the `pytorch-crf` (torchcrf) package (`_compute_score` with gather over tags,
    `_compute_normalizer` with torch.logsumexp looping over time with
    `torch.where(mask[i].unsqueeze(1), next_score, score)`, reduction="mean").

Habits copied: a collate_fn that pads and sorts the batch by length (descending,
enforce_sorted=True), a DataLoader over random variable-length sentences, char
ids padded to the longest word, max-pool over the char CNN, dropout, Adam,
clip_grad_norm_(5.0), loss = -log-likelihood averaged over the batch, and an
evaluation every few steps with model.eval() + torch.no_grad() + Viterbi decode
(python list backtrace, .tolist()).
"""
import argparse
import random

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--word-vocab", type=int, default=20000)
parser.add_argument("--char-vocab", type=int, default=100)
parser.add_argument("--word-dim", type=int, default=300)
parser.add_argument("--char-dim", type=int, default=30)
parser.add_argument("--char-filters", type=int, default=50)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--max-len", type=int, default=60)
parser.add_argument("--eval-every", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(1)
random.seed(1)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]
START_TAG, STOP_TAG = "<START>", "<STOP>"
tag_to_ix = {t: i for i, t in enumerate(TAGS + [START_TAG, STOP_TAG])}
PAD = 0


class RandomNERDataset(Dataset):
    def __init__(self, n, max_len, word_vocab, char_vocab, n_tags):
        self.data = []
        for _ in range(n):
            L = random.randint(5, max_len)
            words = [random.randint(1, word_vocab - 1) for _ in range(L)]
            chars = [[random.randint(1, char_vocab - 1) for _ in range(random.randint(1, 12))]
                     for _ in range(L)]
            tags = [random.randint(0, n_tags - 1) for _ in range(L)]
            self.data.append((words, chars, tags))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def collate_fn(batch):
    batch = sorted(batch, key=lambda x: len(x[0]), reverse=True)
    lens = [len(b[0]) for b in batch]
    max_len = lens[0]
    max_word = max(len(c) for b in batch for c in b[1])
    words = torch.zeros(len(batch), max_len, dtype=torch.long)
    chars = torch.zeros(len(batch), max_len, max_word, dtype=torch.long)
    tags = torch.zeros(len(batch), max_len, dtype=torch.long)
    for i, (w, c, t) in enumerate(batch):
        words[i, :len(w)] = torch.tensor(w)
        tags[i, :len(t)] = torch.tensor(t)
        for j, cc in enumerate(c):
            chars[i, j, :len(cc)] = torch.tensor(cc)
    return words, chars, tags, torch.tensor(lens)


class CharCNN(nn.Module):
    def __init__(self, n_chars, dim, n_filters, kernel=3):
        super().__init__()
        self.embed = nn.Embedding(n_chars, dim, padding_idx=PAD)
        self.conv = nn.Conv1d(dim, n_filters, kernel, padding=1)

    def forward(self, chars):
        b, s, w = chars.size()
        x = self.embed(chars.view(b * s, w))          # (b*s, w, dim)
        x = self.conv(x.transpose(1, 2))               # (b*s, filters, w)
        x, _ = torch.max(torch.relu(x), dim=2)
        return x.view(b, s, -1)


class CRF(nn.Module):
    def __init__(self, tag_to_ix):
        super().__init__()
        self.tag_to_ix = tag_to_ix
        self.tagset_size = len(tag_to_ix)
        # transitions[i, j] = score of transitioning *to* i *from* j (tutorial convention)
        self.transitions = nn.Parameter(torch.randn(self.tagset_size, self.tagset_size))
        self.transitions.data[tag_to_ix[START_TAG], :] = -10000
        self.transitions.data[:, tag_to_ix[STOP_TAG]] = -10000

    def _forward_alg(self, feats, mask):
        # feats: (B, T, K), mask: (B, T) bool
        B, T, K = feats.shape
        init_alphas = feats.new_full((B, K), -10000.0)
        init_alphas[:, self.tag_to_ix[START_TAG]] = 0.0
        forward_var = init_alphas
        for t in range(T):
            emit = feats[:, t].unsqueeze(2)                          # (B, K, 1)
            next_tag_var = forward_var.unsqueeze(1) + self.transitions.unsqueeze(0) + emit
            next_var = torch.logsumexp(next_tag_var, dim=2)          # (B, K)
            forward_var = torch.where(mask[:, t].unsqueeze(1), next_var, forward_var)
        terminal_var = forward_var + self.transitions[self.tag_to_ix[STOP_TAG]]
        return torch.logsumexp(terminal_var, dim=1)

    def _score_sentence(self, feats, tags, mask):
        B, T, K = feats.shape
        start = torch.full((B, 1), self.tag_to_ix[START_TAG], dtype=torch.long, device=feats.device)
        tags_ext = torch.cat([start, tags], dim=1)
        emit = feats.gather(2, tags.unsqueeze(2)).squeeze(2)         # (B, T)
        trans = self.transitions[tags_ext[:, 1:], tags_ext[:, :-1]]  # (B, T)
        score = ((emit + trans) * mask.float()).sum(1)
        lengths = mask.long().sum(1)
        last_tags = tags.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
        score = score + self.transitions[self.tag_to_ix[STOP_TAG], last_tags]
        return score

    def neg_log_likelihood(self, feats, tags, mask):
        forward_score = self._forward_alg(feats, mask)
        gold_score = self._score_sentence(feats, tags, mask)
        return (forward_score - gold_score).mean()

    def viterbi_decode(self, feats, mask):
        B, T, K = feats.shape
        backpointers = []
        forward_var = feats.new_full((B, K), -10000.0)
        forward_var[:, self.tag_to_ix[START_TAG]] = 0
        for t in range(T):
            next_tag_var = forward_var.unsqueeze(1) + self.transitions.unsqueeze(0)
            best_score, best_id = next_tag_var.max(dim=2)
            next_var = best_score + feats[:, t]
            forward_var = torch.where(mask[:, t].unsqueeze(1), next_var, forward_var)
            backpointers.append(best_id)
        terminal_var = forward_var + self.transitions[self.tag_to_ix[STOP_TAG]]
        best_score, best_last = terminal_var.max(dim=1)
        lengths = mask.long().sum(1).tolist()
        bps = torch.stack(backpointers, 1).tolist()
        best_last = best_last.tolist()
        paths = []
        for b in range(B):
            best = best_last[b]
            path = [best]
            for t in range(lengths[b] - 1, 0, -1):
                best = bps[b][t][best]
                path.append(best)
            path.reverse()
            paths.append(path)
        return best_score, paths


class BiLSTM_CRF(nn.Module):
    def __init__(self, word_vocab, char_vocab, tag_to_ix, word_dim, char_dim, char_filters, hidden):
        super().__init__()
        self.word_embed = nn.Embedding(word_vocab, word_dim, padding_idx=PAD)
        self.char_cnn = CharCNN(char_vocab, char_dim, char_filters)
        self.dropout = nn.Dropout(0.5)
        self.lstm = nn.LSTM(word_dim + char_filters, hidden // 2, num_layers=2,
                            bidirectional=True, batch_first=True, dropout=0.5)
        self.hidden2tag = nn.Linear(hidden, len(tag_to_ix))
        self.crf = CRF(tag_to_ix)

    def _get_lstm_features(self, words, chars, lengths):
        emb = torch.cat([self.word_embed(words), self.char_cnn(chars)], dim=2)
        emb = self.dropout(emb)
        packed = pack_padded_sequence(emb, lengths.cpu(), batch_first=True)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        out = self.dropout(out)
        return self.hidden2tag(out)

    def forward(self, words, chars, lengths, tags=None):
        mask = words != PAD
        feats = self._get_lstm_features(words, chars, lengths)
        if tags is not None:
            return self.crf.neg_log_likelihood(feats, tags, mask)
        return self.crf.viterbi_decode(feats, mask)


train_ds = RandomNERDataset(args.batch_size * args.steps, args.max_len, args.word_vocab,
                            args.char_vocab, len(TAGS))
dev_ds = RandomNERDataset(args.batch_size, args.max_len, args.word_vocab, args.char_vocab, len(TAGS))
train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate_fn)
dev_loader = DataLoader(dev_ds, batch_size=args.batch_size, shuffle=False, collate_fn=collate_fn)

model = BiLSTM_CRF(args.word_vocab, args.char_vocab, tag_to_ix, args.word_dim, args.char_dim,
                   args.char_filters, args.hidden).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def evaluate():
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for words, chars, tags, lengths in dev_loader:
            words, chars, tags = words.to(device), chars.to(device), tags.to(device)
            _, paths = model(words, chars, lengths)
            for b, p in enumerate(paths):
                gold = tags[b, :len(p)].tolist()
                correct += sum(int(x == y) for x, y in zip(p, gold))
                total += len(p)
    model.train()
    return correct / max(total, 1)


step = 0
while step < args.steps:
    for words, chars, tags, lengths in train_loader:
        model.train()
        words, chars, tags = words.to(device), chars.to(device), tags.to(device)
        model.zero_grad()
        loss = model(words, chars, lengths, tags)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        step += 1
        if step % args.eval_every == 0:
            acc = evaluate()
            print(f"step {step} loss {loss.item():.4f} dev acc {acc:.3f}")
        if step >= args.steps:
            break
print("done")
