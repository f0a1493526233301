"""How many experts a pool can keep across prompts that sweep every expert of every layer (Qwen3-Next's prompts:
a 2048-token ubatch routes nearly all 512 experts of a layer), whatever its victim order. CPU only, no model.

    python bench/sweep_residency.py [--layers 12] [--experts 512] [--slots 2205] [--ahead 1,2] [--prompts 4]
                                    [--regions N]

The prompt path keeps the layer being computed and the next `ahead` layers (copied ahead) wholly resident; every
other slot may hold experts kept from earlier prompts. Two victim orders: LRU, and the farthest next use in the
layers' cycle (Belady's order, optimal when every expert of a layer is used at each pass). Prints each prompt's
misses, and the share of a prompt's experts that cross the link after the first prompt, on average (the misses
cycle with a period of a few prompts; bench/RESULTS.md, stop 26). `--regions N` splits the pool as a float pool of
more than 1023 slots was (until stop 47): layer l keeps its experts in region l mod N, so the victims of its
misses are that region's (`--slots 2666 --regions 3`: the BF16 pool at 16000 MiB; bench/RESULTS.md, stop 27).
"""
import argparse

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--experts", type=int, default=512)
ap.add_argument("--slots", type=int, default=2205, help="Qwen3-Next Q4_K_M at 4000 MiB: 2205 slots of 1.9 MB")
ap.add_argument("--ahead", default="1,2", help="layers copied ahead, comma list")
ap.add_argument("--prompts", type=int, default=10)
ap.add_argument("--regions", type=int, default=1, help="regions of the pool, taken by the layers in turn")
ns = ap.parse_args()
L, E, S, R = ns.layers, ns.experts, ns.slots, ns.regions
CAP = [S // R + (r < S % R) for r in range(R)]           # slots a region


def sweep(order: str, ahead: int, prompts: int) -> list[int]:
    """Misses per prompt. resident (L, E): last use time, -1 where absent."""
    last = np.full((L, E), -1, dtype=np.int64)
    t, out = 0, []
    for _ in range(prompts):
        misses = 0
        for cur in range(L):
            active = np.zeros(L, dtype=bool)
            active[cur:cur + ahead + 1] = True
            for layer in np.flatnonzero(active):
                need = np.flatnonzero(last[layer] < 0)
                mine = np.arange(L) % R == layer % R              # the layers that share this layer's region
                over = int((last[mine] >= 0).sum()) + len(need) - CAP[layer % R]
                if over > 0:                                  # victims among the region's inactive layers' experts
                    ls, es = np.nonzero((last >= 0) & ~active[:, None] & mine[:, None])
                    if order == "lru":
                        key = last[ls, es]
                    else:                                     # farthest next use first: the layers just passed
                        key = -((ls - cur) % L) * E + es
                    pick = np.argsort(key, kind="stable")[:over]
                    last[ls[pick], es[pick]] = -1
                last[layer, need] = t
                misses += len(need)
            last[cur] = t
            t += 1
        out.append(misses)
    return out


for ahead in (int(a) for a in ns.ahead.split(",")):
    for order in ("lru", "belady"):
        m = sweep(order, ahead, ns.prompts)
        print(f"ahead {ahead}, {order:6s}: misses a prompt {m}; after the first, {np.mean(m[1:]) / (L * E):.1%} of "
              "the experts")
