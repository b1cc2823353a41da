"""How far a bf16 sum of per-rank gradients drifts from the exact sum, by number of ranks
(the numerical reason for ShardConfig.reduce_dtype="fp32"; comparisons/results/reduce_dtype.md).

    python comparisons/bf16_sum_error.py

tiny-llama in bf16, one 32-token sequence per "rank" (real text, amsp_ext.common.data), the bf16
gradients summed one rank at a time (as a ring all-reduce adds them) in bf16 and in fp32, each
compared with the fp64 sum: relative L2 error. One process, a few seconds.
"""

import torch

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss


def main() -> None:
    torch.manual_seed(0)
    model = build_llama("tiny-llama", seed=0).to(torch.bfloat16)
    grads = []
    for r in range(256):
        b = micro_batch(0, 0, r, world_size=256, num_micro_batches=1, micro_batch_size=1, seq_len=32)
        model.zero_grad()
        causal_lm_loss(model, b).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    g = torch.stack(grads)
    for n in (4, 16, 64, 256):
        exact = g[:n].double().sum(0)
        s16, s32 = torch.zeros_like(g[0]), torch.zeros(g.shape[1])
        for x in g[:n]:
            s16 += x
            s32 += x.float()
        err = [float((s.double() - exact).norm() / exact.norm()) for s in (s16, s32)]
        print(f"{n:4d} ranks: bf16 sum rel. error {err[0]:.2e}, fp32 sum {err[1]:.2e}")


if __name__ == "__main__":
    main()
