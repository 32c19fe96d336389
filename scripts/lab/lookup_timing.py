"""Lab probe behind docs/experiments/design-measurements.md ("The lookup index").

Which index should context lookup use? Times three on copy-heavy token streams (the numbers in
engine/core/lookup.py).

Each index is fed the stream 4 tokens at a time (as iterations commit them) and asked, every 10th step, for the
longest earlier match of the stream's end and what followed its occurrences (up to 4 continuations of 8 tokens):
- "ngram-hash": engine.core.lookup.LookupIndex, one dict entry per n-gram of every order min..max;
- "bigram+extend": one dict of min-order n-grams; each occurrence's match length found by comparing backwards;
- "suffix-automaton": online suffix automaton; endpos of a state by walking its subtree of suffix links.
Usage: python -m scripts.lab.lookup_timing [--lengths 2000 8000]
"""
from __future__ import annotations

import argparse
import random
import time

from engine.core.lookup import LookupIndex

MIN, MAX, STEP, CONTS, LEN = 2, 8, 4, 4, 8


def stream(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """Text-like: half the time copy a 5-20 token span from earlier (what lookup feeds on), else fresh tokens."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randint(5, 20)]
        else:
            out += [int(rng.paretovariate(1.2)) % vocab for _ in range(rng.randint(1, 8))]
    return out[:n]


class BigramExtend:
    def __init__(self):
        self.tokens, self.follows = [], {}

    def extend(self, tokens):
        for t in tokens:
            self.tokens.append(t)
            if len(self.tokens) >= MIN:
                self.follows.setdefault(tuple(self.tokens[-MIN:]), []).append(len(self.tokens))

    def continuations(self, max_continuations, max_len):
        s, n = self.tokens, len(self.tokens)
        by_len = {}
        for e in self.follows.get(tuple(s[-MIN:]), [])[:-1]:
            k = MIN
            while k < MAX and e - k - 1 >= 0 and s[e - k - 1] == s[n - k - 1]:
                k += 1
            by_len.setdefault(k, []).append(e)
        out = []
        for k in sorted(by_len, reverse=True):
            out += [s[e:e + max_len] for e in by_len[k][::-1]]
        return out[:max_continuations]


class SuffixAutomaton:
    def __init__(self):
        self.next, self.link, self.len, self.pos, self.kids = [{}], [-1], [0], [-1], [set()]
        self.last, self.tokens = 0, []

    def _state(self, length, pos):
        self.next.append({}), self.link.append(-1), self.len.append(length), self.pos.append(pos)
        self.kids.append(set())
        return len(self.len) - 1

    def _relink(self, v, parent):
        if self.link[v] >= 0:
            self.kids[self.link[v]].discard(v)
        self.link[v] = parent
        self.kids[parent].add(v)

    def extend(self, tokens):
        for c in tokens:
            self.tokens.append(c)
            cur, p = self._state(self.len[self.last] + 1, len(self.tokens)), self.last
            while p != -1 and c not in self.next[p]:
                self.next[p][c], p = cur, self.link[p]
            if p == -1:
                self._relink(cur, 0)
            else:
                q = self.next[p][c]
                if self.len[p] + 1 == self.len[q]:
                    self._relink(cur, q)
                else:
                    clone = self._state(self.len[p] + 1, -1)
                    self.next[clone] = dict(self.next[q])
                    self._relink(clone, self.link[q])
                    while p != -1 and self.next[p].get(c) == q:
                        self.next[p][c], p = clone, self.link[p]
                    self._relink(q, clone), self._relink(cur, clone)
            self.last = cur

    def continuations(self, max_continuations, max_len):
        v, n, out = self.link[self.last], len(self.tokens), []  # v: the longest suffix that also ends earlier
        while v > 0 and self.len[v] >= MIN and len(out) < max_continuations:  # then shorter suffixes
            ends, stack = [], [v]
            while stack:  # endpos(v): the positions of the non-clone states under v
                u = stack.pop()
                if 0 <= self.pos[u] < n:
                    ends.append(self.pos[u])
                stack += self.kids[u]
            out += [c for c in (self.tokens[e:e + max_len] for e in sorted(ends, reverse=True)) if c not in out]
            v = self.link[v]
        return out[:max_continuations]


def measure(make, tokens):
    index, build, query, queries = make(), 0.0, 0.0, 0
    for step, at in enumerate(range(0, len(tokens), STEP)):
        t0 = time.perf_counter()
        index.extend(tokens[at:at + STEP])
        t1 = time.perf_counter()
        build += t1 - t0
        if step % 10 == 9:
            index.continuations(CONTS, LEN)
            query += time.perf_counter() - t1
            queries += 1
    return 1e6 * build / len(tokens), 1e6 * query / max(queries, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    args = ap.parse_args()
    makers = {"ngram-hash": lambda: LookupIndex(MIN, MAX), "bigram+extend": BigramExtend,
              "suffix-automaton": SuffixAutomaton}
    for n in args.lengths:
        tokens = stream(n)
        for name, make in makers.items():
            per_token, per_query = min(measure(make, tokens) for _ in range(3))  # the CPU is shared: best of 3
            print(f"n={n:5d}  {name:17s} extend {per_token:6.2f} us/token   query {per_query:8.1f} us")


if __name__ == "__main__":
    main()
