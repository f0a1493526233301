"""Does an expert's grouped-GEMM result depend on the pool it sits in? (the bit-identity contract on CUDA)

    python bench/grouped_identity.py

Reference-model shapes (H 2048, I 768, top-8 of 128). The same experts and tokens, computed from a 128-slot array
(expert id = slot) and from pools of other sizes with the experts at random slots: prints, per ubatch size and
pool size, whether the outputs are bit-identical and how many groups per launch and rows per group that was.
"""
import torch

from moestream.kernels.grouped import experts_grouped

torch.manual_seed(0)
H, I, E, K = 2048, 768, 128, 8
dev = "cuda"
w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)
w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
for T in (1, 64, 512, 2048, 4096):
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    logits = torch.randn(T, E, device=dev) + torch.linspace(3, 0, E, device=dev)   # skewed, like real routing
    ids = torch.topk(logits, K, dim=-1).indices
    base = experts_grouped(x, ids, w13, w2)
    for S in (128, 300, 851, 1023, 1702, 2550):
        perm = torch.randperm(S, device=dev)[:E]                  # expert e lives in slot perm[e]
        pool13 = torch.zeros(S, 2 * I, H, device=dev, dtype=torch.bfloat16)
        pool2 = torch.zeros(S, H, I, device=dev, dtype=torch.bfloat16)
        pool13[perm], pool2[perm] = w13, w2
        out = experts_grouped(x, perm[ids], pool13, pool2)
        same = torch.equal(out, base)
        diff = (out.float() - base.float()).abs().max().item()
        print(f"T={T:5d} S={S:5d} rows/group={T * K / min(S, 1023):7.1f} identical={same} max|diff|={diff:.3g}",
              flush=True)
        del pool13, pool2
