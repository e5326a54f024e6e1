"""Where the sparse dB are: a sweep of LISTA's schedule and Stage I's oracle on the paper's problem (issue 10).

K variants of LISTA (T=20, 250x500, SNR 20/30/40, the library's problem and test set) train at once as
stacked (K, ...) tensors multiplied with bmm, so one GPU process sweeps learning rates, shrinkages and
Stage I objectives side by side. Adam is written out (standard: betas 0.9/0.999, eps 1e-8, bias-corrected)
because each variant has its own learning rate inside one stacked tensor; the schedule is cosine to 1 %.
Each variant reports the test NMSE (dB), mixed and per SNR, at full depth, at the best step per sample
(the oracle a policy is trained towards) and at the best fixed step per SNR level.

    OUT=runs/sweep LIMIT=480 python benchmarks/sparse_schedule_sweep.py          # schedules, then Stage I
    OUT=runs/sweep MODE=beta python benchmarks/sparse_schedule_sweep.py          # Stage I's beta
    SCALE=0.002 ... runs every length scaled down (a smoke run on CPU)

A GPU is advised (an H200 ran the first in 480 s with LIMIT=480, the second in 200 s); results are
appended to $OUT/results.jsonl. LIMIT (seconds) stops training early: variants cut by it report partial runs.
"""
import json
import math
import os
import time

import torch
from learn2stop.tasks.sparse.problem import ProblemConfig, make_matrix, fixed_set

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
OUT = os.environ.get("OUT", "/tmp/sweep_out")
os.makedirs(OUT, exist_ok=True)
T0 = time.time()
LIMIT = float(os.environ.get("LIMIT", 1e9))
cfg = ProblemConfig()
A = make_matrix(cfg).to(dev)
test = fixed_set(A.cpu(), cfg, cfg.test_per_snr, cfg.test_seed).to(dev)
m, n = A.shape
Tn = 20


def init(K):
    eye = torch.eye(n, device=dev)
    Wx = (eye - A.T @ A / 3.0).expand(K, Tn, n, n).clone()
    Wb = (A.T / 3.0).expand(K, Tn, n, m).clone()
    th = torch.full((K, Tn), 0.1 / 3.0, device=dev)
    return [Wx, Wb, th]


def forward(P, y, smooth):  # y (K,B,m) -> xs (K,B,T,n)
    Wx, Wb, th = P
    x, outs = None, []
    for t in range(Tn):
        v = torch.bmm(y, Wb[:, t].transpose(1, 2))
        if x is not None:
            v = v + torch.bmm(x, Wx[:, t].transpose(1, 2))
        theta = th[:, t].view(-1, 1, 1)
        soft = torch.sign(v) * torch.relu(v.abs() - theta)
        if smooth is not None:
            sm = torch.tanh(2.5 * v) * torch.relu(v.abs() - theta)
            soft = torch.where(smooth.view(-1, 1, 1), sm, soft)
        x = soft
        outs.append(x)
    return torch.stack(outs, 2)


def sample(K, B, g):
    sup = torch.rand(K, B, n, device=dev, generator=g) < 0.1
    x = torch.randn(K, B, n, device=dev, generator=g) * sup
    clean = x @ A.T
    snr = torch.tensor([20., 30., 40.], device=dev)[torch.randint(3, (K, B), device=dev, generator=g)]
    std = clean.std(dim=2, keepdim=True) * 10 ** (-snr[..., None] / 20)
    return clean + std * torch.randn(K, B, m, device=dev, generator=g), x


def objective(kind, beta, l):  # l (K,B,T) per-sample squared error -> (K,)
    out = []
    for k in range(l.shape[0]):
        lk = l[k]
        if kind[k] == "ds":
            out.append(lk.mean())
        elif kind[k] == "marginal":
            out.append((-beta[k] * torch.logsumexp(-lk / beta[k], 1)).mean())
        elif kind[k] == "expected":
            out.append((torch.softmax(-lk / beta[k], 1) * lk).sum(1).mean())
        elif kind[k] == "last":
            out.append(lk[:, -1].mean())
    return torch.stack(out)


@torch.no_grad()
def evaluate(P, smooth):
    K = P[0].shape[0]
    errs = []
    for i in range(0, len(test), 1000):
        y, x = test.y[i:i + 1000], test.x[i:i + 1000]
        xs = forward(P, y.expand(K, -1, -1).contiguous(), smooth)
        errs.append((xs - x[None, :, None]).pow(2).sum(-1))
    e = torch.cat(errs, 1)  # K,N,T
    energy = test.x.pow(2).sum(1)
    res = []
    for k in range(K):
        r = {}
        def db(v, msk=None):
            if msk is None:
                return round(float(10 * torch.log10(v.sum() / energy.sum())), 3)
            return round(float(10 * torch.log10(v[msk].sum() / energy[msk].sum())), 3)
        full, orc = e[k, :, -1], e[k].min(1).values
        r["full"] = {"mixed": db(full), **{str(int(s)): db(full, test.snr == s) for s in (20, 30, 40)}}
        r["oracle"] = {"mixed": db(orc), **{str(int(s)): db(orc, test.snr == s) for s in (20, 30, 40)}}
        best = torch.zeros_like(full); layers = {}
        for s in (20, 30, 40):
            msk = test.snr == s
            per_layer = e[k][msk].sum(0)
            j = int(per_layer.argmin()); layers[str(s)] = j + 1
            best[msk] = e[k][msk][:, j]
        r["snr_best_layer"] = {"mixed": db(best), **{str(int(s)): db(best, test.snr == s) for s in (20, 30, 40)}, "layers": layers}
        r["per_layer_mixed"] = [round(float(10 * torch.log10(e[k, :, t].sum() / energy.sum())), 2) for t in range(Tn)]
        res.append(r)
    return res


def train(P, names, kind, beta, lrs, smooth, iters, B, lr_min=0.01, seed=0, evals=()):
    K = len(names)
    g = torch.Generator(device=dev).manual_seed(seed)
    P = [p.clone().requires_grad_(True) for p in P]
    mom = [torch.zeros_like(p) for p in P]; var = [torch.zeros_like(p) for p in P]
    lr0 = torch.tensor(lrs, device=dev)
    beta = list(beta)
    t0 = time.time(); hist = []
    for it in range(1, iters + 1):
        y, x = sample(K, B, g)
        xs = forward(P, y, smooth)
        l = (xs - x[:, :, None]).pow(2).sum(-1)
        loss = objective(kind, beta, l)
        grads = torch.autograd.grad(loss.sum(), P)
        frac = (it - 1) / max(iters - 1, 1)
        lr = lr0 * (lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi * frac)))
        with torch.no_grad():
            for p, gr, mm, vv in zip(P, grads, mom, var):
                mm.mul_(0.9).add_(gr, alpha=0.1); vv.mul_(0.999).addcmul_(gr, gr, value=0.001)
                mh = mm / (1 - 0.9 ** it); vh = vv / (1 - 0.999 ** it)
                p.sub_(lr.view(-1, *([1] * (p.dim() - 1))) * mh / (vh.sqrt() + 1e-8))
        if it in evals:
            res = evaluate(P, smooth)
            hist.append({"it": it, "sec": round(time.time() - t0, 1), "full_mixed": [r["full"]["mixed"] for r in res],
                         "full20": [r["full"]["20"] for r in res]})
            print(f"  it {it} {time.time()-t0:.0f}s", hist[-1], flush=True)
        if time.time() - T0 > LIMIT:
            print("LIMIT hit at", it, flush=True); break
    return [p.detach() for p in P], hist


def report(tag, names, P, smooth, hist, extra):
    res = evaluate(P, smooth)
    for name, r in zip(names, res):
        rec = {"tag": tag, "name": name, **extra, **r, "hist": hist}
        print(json.dumps({k: v for k, v in rec.items() if k not in ("hist", "per_layer_mixed")}), flush=True)
        with open(f"{OUT}/results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def stage1_branch(Pk, tag, iters, B, lr, smooth_flag, variants):
    K = len(variants)
    P = [p.expand(K, *p.shape[1:]).clone() for p in Pk]
    names = [v[0] for v in variants]
    smooth = torch.tensor([smooth_flag] * K, device=dev)
    P, hist = train(P, names, [v[1] for v in variants], [v[2] for v in variants], [lr] * K, smooth, iters, B, seed=7)
    report(tag, names, P, smooth, hist, {"iters": iters, "B": B, "lr": lr})


def beta_mode(scale):
    n = lambda v: max(int(v * scale), 2)
    sm = torch.tensor([False], device=dev)
    P, hist = train(init(1), ["b1024_lr1e-3"], ["ds"], [1.0], [1e-3], sm, n(6000), 1024)
    report("baseline", ["b1024_lr1e-3_6k"], P, sm, hist, {"iters": n(6000), "B": 1024})
    variants = [("marg_0.02", "marginal", 0.02), ("marg_0.05", "marginal", 0.05), ("marg_0.1", "marginal", 0.1),
                ("exp_0.1", "expected", 0.1)]
    stage1_branch(P, "stage1_from_b1024_6k", n(3000), 512, 5e-4, False, variants)
    print("total", time.time() - T0, flush=True)


def main() -> None:
    if os.environ.get("MODE") == "beta":
        beta_mode(float(os.environ.get("SCALE", 1.0)))
        return
    scale = float(os.environ.get("SCALE", 1.0))
    N = lambda v: max(int(v * scale), 2)
    print("device", dev, torch.cuda.get_device_name() if dev == "cuda" else "", flush=True)
    # Group 1: batch 512 (CPU 179 ms/iter) 13000 iters ~ 2330 s CPU
    g1 = [("b512_lr1e-3", "ds", 1.0, 1e-3, False), ("b512_lr2e-3", "ds", 1.0, 2e-3, False),
          ("b512_lr5e-4", "ds", 1.0, 5e-4, False), ("b512_lr1e-3_smooth", "ds", 1.0, 1e-3, True)]
    it1 = N(13000)
    P, hist = train(init(len(g1)), [c[0] for c in g1], [c[1] for c in g1], [c[2] for c in g1], [c[3] for c in g1],
                    torch.tensor([c[4] for c in g1], device=dev), it1, 512, evals=set(N(v) for v in (2000, 4000, 6500, 9000)))
    sm1 = torch.tensor([c[4] for c in g1], device=dev)
    report("baseline", [c[0] for c in g1], P, sm1, hist, {"iters": it1, "B": 512})
    torch.save([p.cpu() for p in P], f"{OUT}/g1.pt")
    variants = [("cont_ds", "ds", 1.0), ("marg_0.28", "marginal", 0.28), ("exp_0.28", "expected", 0.28),
                ("exp_0.05", "expected", 0.05), ("marg_0.05", "marginal", 0.05), ("exp_1.0", "expected", 1.0)]
    for idx in (0, 1):
        stage1_branch([p[idx:idx + 1] for p in P], f"stage1_from_{g1[idx][0]}", N(3000), 512, 5e-4, g1[idx][4], variants)
    # Group 2: batch 1024 (CPU 293 ms) 8000 iters ~ 2340 s CPU
    g2 = [("b1024_lr1e-3", "ds", 1.0, 1e-3, False), ("b1024_lr2e-3", "ds", 1.0, 2e-3, False)]
    it2 = N(8000)
    sm2 = torch.tensor([c[4] for c in g2], device=dev)
    P2, hist2 = train(init(2), [c[0] for c in g2], [c[1] for c in g2], [c[2] for c in g2], [c[3] for c in g2], sm2, it2, 1024,
                      evals=set(N(v) for v in (2000, 4000)))
    report("baseline", [c[0] for c in g2], P2, sm2, hist2, {"iters": it2, "B": 1024})
    stage1_branch([p[1:2] for p in P2], "stage1_from_b1024_lr2e-3", N(3000), 512, 5e-4, False, variants[:3])
    for idx in (2, 3):
        stage1_branch([p[idx:idx + 1] for p in P], f"stage1_from_{g1[idx][0]}", N(3000), 512, 5e-4, g1[idx][4], variants[:3])
    print("total", time.time() - T0)


if __name__ == "__main__":
    main()
