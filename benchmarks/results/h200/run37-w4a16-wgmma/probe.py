"""Structured inputs for the wgmma kernel, to tell which index is wrong where the tests fail:
(a) every weight 1, x row m all m + 1: y[m, n] = K (m + 1) tests the activation rows and the
output layout; (b) weight row n all (n % 7) - 3, x ones: the weight rows; (c) weight (k % 16)
- 8, x one-hot at k0: y = (k0 % 16) - 8 tests the k order of A against B; (d) random."""

import sys

import torch

sys.path.insert(0, ".")
from pagoda.kernels.w4a16 import w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_wgmma import WgmmaConfig  # noqa: E402
from pagoda.model.quantization.w4_layout import pack_w4  # noqa: E402

N, K, M = 128, 256, 64
dev = "cuda"


def run(q, z, s, x, cfg=WgmmaConfig(split_k=1)):
    qweight = pack_w4(q.to(torch.int32)).to(dev)
    groups = K // 128
    zeros = torch.full((groups, N), z, dtype=torch.uint8, device=dev)
    scales = torch.full((groups, N), s, dtype=torch.float16, device=dev)
    return (
        w4a16_linear(x.to(dev, torch.bfloat16), qweight, scales, zeros, 128, config=cfg)
        .float()
        .cpu()
    )


def report(name, y, ref):
    bad = (y - ref).abs() > 1e-2 * ref.abs().max().clamp(min=1)
    print(f"{name}: {'ok' if not bad.any() else f'{int(bad.sum())} of {bad.numel()} wrong'}")
    if bad.any():
        idx = bad.nonzero()[:6].tolist()
        print(
            "   first wrong (m, n): got / want",
            [(i, j, y[i, j].item(), ref[i, j].item()) for i, j in idx],
        )
        print("   y[0:4, 0:8]", y[:4, :8].tolist())
        print("   y[8:10, 0:4]", y[8:10, :4].tolist())


q = torch.full((N, K), 9)
x = (torch.arange(M)[:, None] + 1).float().expand(M, K) / 64
report("a rows", run(q, 8, 1.0, x), (K * (torch.arange(M)[:, None] + 1).float() / 64).expand(M, N))
q = (torch.arange(N)[:, None] % 7 + 5).expand(N, K)
report(
    "b weight rows",
    run(q, 8, 1.0, torch.ones(M, K)),
    (K * (torch.arange(N) % 7 - 3).float())[None, :].expand(M, N),
)
q = (torch.arange(K)[None, :] % 16).expand(N, K)
for k0 in (0, 1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 100, 127, 128, 200):
    x = torch.zeros(M, K)
    x[:, k0] = 1
    y = run(q, 8, 1.0, x)
    got = y[0, 0].item()
    print(f"c k0={k0}: y {got} want {(k0 % 16) - 8}{'' if got == (k0 % 16) - 8 else '  WRONG'}")
g = torch.Generator().manual_seed(0)
q = torch.randint(0, 16, (N, K), generator=g)
x = torch.randn(M, K, generator=g)
ref = x.to(torch.bfloat16).float() @ ((q - 8).float() * 0.01).t()
report("d random", run(q, 8, 0.01, x), ref)
