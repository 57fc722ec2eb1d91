"""Write a synthetic Mooncake-format trace (JSON lines) that mixes three kinds of traffic, to replay eviction
policies on something other than the conversation trace (``pagedkv replay OUT --eviction-policy ...``):

- chats (40% of requests): one of 4 system prompts (2 trace blocks of 512 tokens), then turns; each turn repeats
  the whole previous prompt plus 1-3 new blocks; a conversation has a geometric number of turns (mean 3) and its
  next turn comes an exponential number of requests later (mean ``--gap``);
- templates (30%): one of 50 few-shot templates (8 blocks), Zipf-popular, plus one block of question;
- documents (30%): a system prompt plus 10-30 blocks seen once (a scan that pollutes an LRU cache).

Deterministic for a seed. ``python scripts/synth_trace.py OUT.jsonl [--requests 6000] [--seed 0] [--gap 300]``
"""

from __future__ import annotations

import argparse
import heapq
import json

import numpy as np


def synth(requests: int, seed: int, gap: float) -> list[dict]:
    rng = np.random.default_rng(seed)
    nxt = 0

    def fresh(k: int) -> list[int]:
        nonlocal nxt
        nxt += k
        return list(range(nxt - k, nxt))

    systems = [fresh(2) for _ in range(4)]
    templates = [fresh(8) for _ in range(50)]
    zipf = 1.0 / np.arange(1, 51)
    zipf /= zipf.sum()
    due: list = []  # (request index due, serial, conversation prompt, turns left)
    out, serial = [], 0
    for i in range(requests):
        if due and due[0][0] <= i:  # a chat's next turn: the previous prompt, its answer and a new message
            _, _, prompt, left = heapq.heappop(due)
            prompt = prompt + fresh(int(rng.integers(1, 4)))
        else:
            u = rng.random()
            if u < 0.4:  # a new chat
                prompt = list(systems[rng.integers(4)]) + fresh(int(rng.integers(1, 4)))
                left = int(rng.geometric(1 / 3)) - 1
            elif u < 0.7:
                prompt, left = templates[rng.choice(50, p=zipf)] + fresh(1), 0
            else:
                prompt, left = list(systems[rng.integers(4)]) + fresh(int(rng.integers(10, 31))), 0
        out.append({"timestamp": i * 100, "input_length": len(prompt) * 512 - int(rng.integers(0, 400)),
                    "output_length": int(rng.integers(50, 500)), "hash_ids": prompt})
        if left > 0:
            serial += 1
            heapq.heappush(due, (i + 1 + int(rng.exponential(gap)), serial, prompt, left - 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap", type=float, default=300.0, help="mean requests between two turns of a chat")
    a = ap.parse_args()
    with open(a.out, "w") as f:
        for r in synth(a.requests, a.seed, a.gap):
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
