"""Kernel tries for the batched engine's training step, measured side by side in one run.

One grouped training step of the paper CNN (G clients x B samples, forward + backward of
cross-entropy, as :func:`fedproto.training.train_stacked` runs it) under each variant below. The
variants alternate ``--repeats`` times; each figure is the median step time. Every variant's
gradients are checked against the engine's in float64 (largest relative difference printed), so
a faster variant is also an exact one.

* ``engine``: what the engine does (grouped convolutions, channels-last, max-pool then ReLU).
* ``nchw``: the same in the default (NCHW) memory layout.
* ``native``: oneDNN off (PyTorch's own grouped convolution).
* ``conv2-unfold``: the second convolution as unfold + batched matmul per client.
* ``conv1-patches``: the first convolution as a batched matmul over input patches computed once
  (the data do not change between rounds).
* ``conv1-polyphase``: the first convolution at the 4 offsets of the 2x2 pooling window with
  stride 2, then an element-wise max: max-pool without the full-resolution map, its zero fill
  and its index tensor.
* ``conv-relu-pool-fused``: the first convolution with its ReLU fused into oneDNN's kernel (a
  post-op), then max-pooling, in one autograd function (bitwise the engine's gradients).
* ``no-page-faults``: the engine in a process whose allocator keeps freed memory
  (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``): large temporaries stop costing page
  faults and kernel zeroing.
* ``compile`` (only with ``--compile``): ``torch.compile`` (inductor) of the engine's forward, the
  backward compiled with it (reported as not measured where no C++ compiler is found); the time of
  its first call (the compilation) is printed.

    python benchmarks/bench_kernels.py                 # G 20, B 8, threads: all cores
    python benchmarks/bench_kernels.py --threads 1 --groups 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from bench_args import positive


def make_inputs(G: int, B: int, dtype=torch.float32, seed: int = 0):
    """Stacked paper-CNN weights of G clients, a batch of B MNIST-like inputs per client
    (normalised background -0.42, 30% ink), labels and dropout masks."""
    from fedproto.models.cnn import PaperCNN

    torch.manual_seed(seed)
    ms = [PaperCNN() for _ in range(G)]
    names = ms[0].batch_params
    P = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in ms]).to(dtype) for k in names}
    X = ((torch.rand(B, G, 28, 28) > 0.7).to(dtype) * 3.2 - 0.42)
    y = torch.randint(0, 10, (G, B))
    noise = {"conv2": (torch.rand(G, B, 20) < 0.5).to(dtype) * 2, "fc1": (torch.rand(G, B, 50) < 0.5).to(dtype) * 2}
    return ms[0], P, X, y, noise


def _tail(P, a, G, B, noise):
    """conv2 output (B, G*20, 8, 8) -> dropout mask, pool, ReLU, fc1, fc2 (as the engine)."""
    c2 = P["conv2.weight"].shape[1]
    a = a * noise["conv2"].permute(1, 0, 2).reshape(B, G * c2, 1, 1)
    a = F.relu(F.max_pool2d(a, 2))
    a = a.reshape(B, G, -1).transpose(0, 1)
    h = F.relu(torch.baddbmm(P["fc1.bias"].unsqueeze(1), a, P["fc1.weight"].transpose(1, 2)))
    return torch.baddbmm(P["fc2.bias"].unsqueeze(1), h * noise["fc1"], P["fc2.weight"].transpose(1, 2)), h


def _conv2(P, a, G):
    w2 = P["conv2.weight"].reshape(-1, *P["conv2.weight"].shape[2:])
    return F.conv2d(a, w2, P["conv2.bias"].reshape(-1), groups=G)


def fwd_engine(m0, P, X, G, noise, ctx):
    return m0.grouped_forward(P, X.contiguous(memory_format=torch.channels_last), G, noise)


def fwd_nchw(m0, P, X, G, noise, ctx):
    B = X.shape[0]
    w1 = P["conv1.weight"].reshape(-1, *P["conv1.weight"].shape[2:])
    a = F.relu(F.max_pool2d(F.conv2d(X.contiguous(), w1, P["conv1.bias"].reshape(-1), groups=G), 2))
    return _tail(P, _conv2(P, a, G), G, B, noise)


def fwd_native(m0, P, X, G, noise, ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a note about TF32 on Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False):
            return fwd_nchw(m0, P, X, G, noise, ctx)


def fwd_conv2_unfold(m0, P, X, G, noise, ctx):
    B = X.shape[0]
    w1 = P["conv1.weight"].reshape(-1, *P["conv1.weight"].shape[2:])
    xb = X.contiguous(memory_format=torch.channels_last)
    a = F.relu(F.max_pool2d(F.conv2d(xb, w1, P["conv1.bias"].reshape(-1), groups=G), 2)).contiguous()
    p = F.unfold(a, 5).view(B, G, 250, 64).permute(1, 2, 0, 3).reshape(G, 250, B * 64)
    o = torch.baddbmm(P["conv2.bias"].unsqueeze(-1), P["conv2.weight"].reshape(G, 20, 250), p)  # (G, 20, B*64)
    o = o.view(G, 20, B, 8, 8).permute(2, 0, 1, 3, 4).reshape(B, G * 20, 8, 8)
    return _tail(P, o, G, B, noise)


def fwd_conv1_patches(m0, P, X, G, noise, ctx):
    B = X.shape[0]
    if "patches" not in ctx:  # computed once, as the data do not change between rounds
        ctx["patches"] = F.unfold(X.reshape(B * G, 1, 28, 28), 5).view(B, G, 25, 576).permute(1, 2, 0, 3).contiguous()
    p = ctx["patches"].reshape(G, 25, B * 576)
    o = torch.baddbmm(P["conv1.bias"].reshape(G, 10, 1), P["conv1.weight"].reshape(G, 10, 25), p)  # (G, 10, B*576)
    a = o.view(G, 10, B, 24, 24).permute(2, 0, 1, 3, 4).reshape(B, G * 10, 24, 24)
    a = F.relu(F.max_pool2d(a, 2)).contiguous(memory_format=torch.channels_last)
    return _tail(P, _conv2(P, a, G), G, B, noise)


def fwd_conv1_polyphase(m0, P, X, G, noise, ctx):
    B = X.shape[0]
    xb = X.contiguous(memory_format=torch.channels_last)
    w1 = P["conv1.weight"].reshape(-1, *P["conv1.weight"].shape[2:])
    b1 = P["conv1.bias"].reshape(-1)
    o = [F.conv2d(xb[:, :, dy:dy + 27, dx:dx + 27], w1, b1, stride=2, groups=G) for dy in (0, 1) for dx in (0, 1)]
    a = F.relu(torch.maximum(torch.maximum(o[0], o[1]), torch.maximum(o[2], o[3])))
    return _tail(P, _conv2(P, a, G), G, B, noise)


class _ConvReluPool(torch.autograd.Function):
    """Grouped convolution with the ReLU fused into oneDNN's kernel (a post-op), then 2x2
    max-pooling; the backward masks the pooled gradient as ReLU after pooling does, so every
    gradient is the engine's bit for bit (ReLU and max-pooling commute)."""

    @staticmethod
    def forward(ctx, x, w, b, G):
        if x.dtype == torch.float32:
            a = torch.ops.mkldnn._convolution_pointwise(x, w, b, [0, 0], [1, 1], [1, 1], G, "relu", [], "")
        else:  # oneDNN has no float64 kernels: the same computation unfused
            a = F.relu(F.conv2d(x, w, b, groups=G))
        p, idx = torch.ops.aten.max_pool2d_with_indices(a, [2, 2], [2, 2])
        ctx.save_for_backward(x, w, a, p, idx)
        ctx.G = G
        return p

    @staticmethod
    def backward(ctx, gp):
        x, w, a, p, idx = ctx.saved_tensors
        g = torch.ops.aten.threshold_backward(gp, p, 0)
        ga = torch.ops.aten.max_pool2d_with_indices_backward(g, a, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
        gx, gw, gb = torch.ops.aten.convolution_backward(ga, x, w, [w.shape[0]], [1, 1], [0, 0], [1, 1], False,
                                                         [0, 0], ctx.G, [ctx.needs_input_grad[0], True, True])
        return gx, gw, gb, None


def fwd_fused(m0, P, X, G, noise, ctx):
    B = X.shape[0]
    xb = X.contiguous(memory_format=torch.channels_last)
    w1 = P["conv1.weight"].reshape(-1, *P["conv1.weight"].shape[2:])
    a = _ConvReluPool.apply(xb, w1, P["conv1.bias"].reshape(-1), G)
    return _tail(P, _conv2(P, a, G), G, B, noise)


VARIANTS = {"engine": fwd_engine, "nchw": fwd_nchw, "native": fwd_native, "conv2-unfold": fwd_conv2_unfold,
            "conv1-patches": fwd_conv1_patches, "conv1-polyphase": fwd_conv1_polyphase,
            "conv-relu-pool-fused": fwd_fused}


def grads(fwd, m0, P, X, y, noise, ctx):
    Pr = {k: v.detach().clone().requires_grad_(True) for k, v in P.items()}
    logits, h = fwd(m0, Pr, X, X.shape[1], noise, ctx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return torch.autograd.grad(loss, list(Pr.values()))


def exactness(name: str, G: int, B: int) -> float:
    """Largest relative gradient difference from the engine's, in float64."""
    m0, P, X, y, noise = make_inputs(G, B, torch.float64)
    ref = grads(fwd_engine, m0, P, X, y, noise, {})
    got = grads(VARIANTS[name], m0, P, X, y, noise, {})
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))


def bitwise(name: str, G: int, B: int) -> bool:
    """True when the variant's float32 gradients equal the engine's bit for bit."""
    m0, P, X, y, noise = make_inputs(G, B)
    ref = grads(fwd_engine, m0, P, X, y, noise, {})
    got = grads(VARIANTS[name], m0, P, X, y, noise, {})
    return all(torch.equal(a, b) for a, b in zip(got, ref))


CLOCK = time.perf_counter  # --clock cpu: time.process_time (robust on a loaded machine, 1 thread)


def time_step(fn, n: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t = CLOCK()
        fn()
        ts.append(CLOCK() - t)
    return statistics.median(ts)


def measure(name: str, G: int, B: int, n: int) -> float:
    m0, P, X, y, noise = make_inputs(G, B)
    ctx: dict = {}
    if name == "compile":
        fwd_c = torch.compile(fwd_engine, dynamic=False)

        def step():
            return grads(fwd_c, m0, P, X, y, noise, ctx)
        t, c = time.perf_counter(), time.process_time()
        step()
        print(f"compile: first call (compilation) {time.perf_counter() - t:.1f} s wall, "
              f"{time.process_time() - c:.1f} s CPU of this process")
        if G > 1:  # the engine's group shrinks as clients run out of data: each new size recompiles
            m1, P1, X1, y1, noise1 = make_inputs(G - 1, B)
            t, c = time.perf_counter(), time.process_time()
            grads(fwd_c, m1, P1, X1, y1, noise1, {})
            print(f"compile: recompilation for {G - 1} clients {time.perf_counter() - t:.1f} s wall, "
                  f"{time.process_time() - c:.1f} s CPU of this process")
    else:
        fwd = VARIANTS["engine" if name == "no-page-faults" else name]

        def step():
            return grads(fwd, m0, P, X, y, noise, ctx)
    return time_step(step, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=positive, default=20, help="clients G (default 20)")
    p.add_argument("--batch", type=positive, default=8, help="samples per client B (default 8)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=positive, default=60, help="timed steps per measurement (default 60)")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--compile", action="store_true", help="also try torch.compile (needs a C++ compiler)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall (default) or the process's CPU time (meaningful with --threads 1)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.one:  # one measurement in this process (the allocator variant needs its own environment)
        print(json.dumps(measure(args.one, args.groups, args.batch, args.steps)))
        return
    names = list(VARIANTS) + ["no-page-faults"] + (["compile"] if args.compile else [])
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.repeats):
        for name in names:
            if name == "no-page-faults":
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(1 << 31),
                           MALLOC_TOP_PAD_=str(1 << 28))
                cmd = [sys.executable, __file__, "--one", name, "--groups", str(args.groups), "--batch",
                       str(args.batch), "--steps", str(args.steps), "--threads", str(torch.get_num_threads()),
                       "--clock", args.clock]
                times[name].append(json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                             text=True).stdout.strip().splitlines()[-1]))
            else:
                try:
                    times[name].append(measure(name, args.groups, args.batch, args.steps))
                except Exception as e:  # torch.compile without a compiler
                    print(f"{name}: not measured ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                    times.pop(name)
                    names.remove(name)
    base = statistics.median(times["engine"])
    nt = torch.get_num_threads()
    print(f"One grouped training step, {args.groups} clients x {args.batch} samples, {nt} "
          f"thread{'s' if nt > 1 else ''}, median of {args.repeats} x {args.steps} steps "
          f"(variants alternating, {args.clock} clock):")
    print("| variant | ms/step | vs engine | float64 gradient difference | float32 bitwise |\n|---|---|---|---|---|")
    out = {}
    for name in names:
        t = statistics.median(times[name])
        exact = exactness(name, args.groups, args.batch) if name in VARIANTS else 0.0
        same = bitwise(name, args.groups, args.batch) if name in VARIANTS else None
        out[name] = {"ms": 1e3 * t, "ratio": base / t, "exact": exact, "float32_bitwise": same}
        print(f"| {name} | {1e3 * t:.2f} | {base / t:.2f}x | {exact:.1e} | {'-' if same is None else same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
