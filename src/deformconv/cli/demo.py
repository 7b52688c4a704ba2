"""Train a small CNN with plain 3x3 convs and the same net with DCNv2 layers (ModulatedDeformConv2dPack)
on glyphs drawn under random scale, rotation, shear, translation and elastic warps (generated in memory,
nothing downloaded), print both results side by side, and draw where the deformable net learned to look."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .args import default_device, positive_float, positive_int
from .args import device as device_arg

HELP = "train plain vs deformable CNNs on warped glyphs and show where DCNv2 looks"

# --- the data: 10 glyphs as strokes in [-1, 1]^2 (y down), drawn under random geometry -----------------

GLYPHS: Dict[str, List[Tuple[float, float, float, float]]] = {
    "L": [(-0.8, -0.5, 0.8, -0.5), (0.8, -0.5, 0.8, 0.6)],
    "T": [(-0.8, -0.7, -0.8, 0.7), (-0.8, 0.0, 0.8, 0.0)],
    "F": [(-0.8, -0.5, 0.8, -0.5), (-0.8, -0.5, -0.8, 0.6), (0.0, -0.5, 0.0, 0.4)],
    "E": [(-0.8, -0.5, 0.8, -0.5), (-0.8, -0.5, -0.8, 0.6), (0.0, -0.5, 0.0, 0.4), (0.8, -0.5, 0.8, 0.6)],
    "H": [(-0.8, -0.6, 0.8, -0.6), (-0.8, 0.6, 0.8, 0.6), (0.0, -0.6, 0.0, 0.6)],
    "Z": [(-0.8, -0.6, -0.8, 0.6), (-0.8, 0.6, 0.8, -0.6), (0.8, -0.6, 0.8, 0.6)],
    "A": [(0.8, -0.7, -0.8, 0.0), (-0.8, 0.0, 0.8, 0.7), (0.2, -0.45, 0.2, 0.45)],
    "square": [(-0.7, -0.7, -0.7, 0.7), (-0.7, 0.7, 0.7, 0.7), (0.7, 0.7, 0.7, -0.7), (0.7, -0.7, -0.7, -0.7)],
    "triangle": [(0.7, -0.8, -0.8, 0.0), (-0.8, 0.0, 0.7, 0.8), (0.7, 0.8, 0.7, -0.8)],
    "cross": [(-0.8, 0.0, 0.8, 0.0), (0.0, -0.8, 0.0, 0.8), (-0.8, -0.3, -0.8, 0.3)],
}
CLASSES = list(GLYPHS)


def make_glyphs(n: int, size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """n images [n, 1, size, size] in [0, 1] plus noise, and labels [n]. Each glyph is drawn with a random
    scale (0.45-1.0), rotation (+-35 deg), shear (+-0.35), translation (+-0.3) and a smooth elastic warp."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    segs = [torch.tensor(GLYPHS[c]) for c in CLASSES]
    nseg = max(len(s) for s in segs)
    table = torch.stack([torch.cat([s, s[:1].repeat(nseg - len(s), 1)]) for s in segs])  # [C, nseg, 4]

    # Inverse geometry: pixel -> glyph coordinates.
    scale = 0.35 + 0.65 * u(n)
    rot = (u(n) - 0.5) * math.radians(70)
    shear = (u(n) - 0.5) * 0.7
    shift = (u(n, 2) - 0.5) * 0.6
    cos, sin = torch.cos(rot), torch.sin(rot)
    lin = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin + shear * cos, cos - shear * sin], -1)], -2)
    lin = lin / scale[:, None, None]
    ax = torch.linspace(-1, 1, size)
    grid = torch.stack(torch.meshgrid(ax, ax, indexing="ij"), -1).reshape(1, -1, 2)  # (y, x)
    # Elastic warp: a smooth random displacement field (coarse noise, upsampled).
    coarse = (u(n, 2, 4, 4) - 0.5) * 0.5
    disp = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=True)
    disp = disp.reshape(n, 2, -1).transpose(1, 2)
    pts = torch.einsum("nij,npj->npi", lin, grid - shift[:, None, :] + disp)  # [n, P, 2]

    s = table[labels]  # [n, nseg, 4]
    a, b = s[:, None, :, :2], s[:, None, :, 2:]
    p = pts[:, :, None, :]
    ab = b - a
    t = (((p - a) * ab).sum(-1) / ab.square().sum(-1).clamp_min(1e-9)).clamp(0, 1)
    d = (p - (a + t[..., None] * ab)).norm(dim=-1).min(-1).values * scale[:, None]  # in image units
    ink = torch.exp(-((d / (2.4 / size)) ** 2))
    img = ink.reshape(n, 1, size, size) + 0.15 * torch.randn(n, 1, size, size, generator=g)
    return img, labels


# --- the two nets ---------------------------------------------------------------------------------------


def _block(cin, cout, stride=1, deform=False):
    if deform:
        from deformconv import ModulatedDeformConv2dPack

        conv = ModulatedDeformConv2dPack(cin, cout, 3, stride=stride, padding=1, bias=False)
    else:
        conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class GlyphNet(nn.Module):
    """Five 3x3 conv blocks (two stride-2), global average pooling, a linear classifier. With
    ``deform=True`` the two stride-1 convs after each downsampling are DCNv2 layers."""

    def __init__(self, width: int, deform: bool, classes: int = len(CLASSES), deform_mid: bool = True):
        super().__init__()
        w = width
        self.stem = _block(1, w)
        self.down1 = _block(w, 2 * w, stride=2)
        self.mid = _block(2 * w, 2 * w, deform=deform and deform_mid)
        self.down2 = _block(2 * w, 4 * w, stride=2)
        self.last = _block(4 * w, 4 * w, deform=deform)
        self.head = nn.Linear(4 * w, classes)

    def features(self, x):
        x = self.down1(self.stem(x))
        mid_in = x
        x = self.down2(self.mid(x))
        return mid_in, x, self.last(x)

    def forward(self, x):
        return self.head(self.features(x)[2].mean((2, 3)))


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def build_nets(dcn_width: int = 12) -> Tuple[GlyphNet, GlyphNet]:
    """The plain net is widened until its parameter count reaches the deformable net's."""
    dcn = GlyphNet(dcn_width, deform=True)
    width = dcn_width
    while n_params(GlyphNet(width + 1, deform=False)) <= n_params(dcn):
        width += 1
    return GlyphNet(width, deform=False), dcn


# --- training -------------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    params: int
    train_loss: List[float]
    test_acc: List[float]
    test_loss: float
    seconds: float


def evaluate(net, x, y, batch=256):
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = net(x[i:i + batch])
            loss += F.cross_entropy(logits, y[i:i + batch], reduction="sum").item()
            correct += (logits.argmax(1) == y[i:i + batch]).sum().item()
    net.train()
    return correct / len(x), loss / len(x)


def train(name, net, data, epochs, batch, lr, device, seed, progress=True) -> Result:
    from tqdm import tqdm

    torch.manual_seed(seed)
    xtr, ytr, xte, yte = (t.to(device) for t in data)
    net.to(device)
    offset_params = [p for n, p in net.named_parameters() if "conv_offset" in n]
    other = [p for n, p in net.named_parameters() if "conv_offset" not in n]
    groups = [{"params": other}] + ([{"params": offset_params, "lr": lr * 0.1}] if offset_params else [])
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=1e-4)
    steps = epochs * math.ceil(len(xtr) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g.get("lr", lr) for g in groups], total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    losses, accs = [], []
    t0 = time.perf_counter()
    for epoch in range(epochs):
        perm = torch.randperm(len(xtr), generator=gen).to(device)
        # disable=None: tqdm draws bars on a terminal only (redirected to a file, they would fill it with redraws)
        bar = tqdm(range(0, len(xtr), batch), desc=f"{name:>6} epoch {epoch + 1}/{epochs}", leave=False,
                   disable=None if progress else True, ncols=80)
        total = 0.0
        for i in bar:
            idx = perm[i:i + batch]
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        losses.append(total / len(xtr))
        accs.append(evaluate(net, xte, yte)[0])
        print(f"{name:>6} epoch {epoch + 1}/{epochs}: train loss {losses[-1]:.3f}, test accuracy {accs[-1]:.1%}")
    seconds = time.perf_counter() - t0
    acc, test_loss = evaluate(net, xte, yte)
    return Result(name, n_params(net), losses, accs, test_loss, seconds)


# --- where the deformable net looks ---------------------------------------------------------------------


def sampling_points(net: GlyphNet, img: torch.Tensor):
    """For one image: the output unit of the last DCN layer nearest the glyph's centre, the 9 sampling
    points of its taps and the 81 points of the first DCN layer's taps at those 9 points, all in input
    pixel coordinates (y, x), with the product of the masks along the way."""
    net.eval()
    with torch.no_grad():
        mid_in, last_in, _ = net.features(img[None])
        off1, m1 = net.mid[0].offset_and_mask(mid_in)       # at H/2 resolution
        off2, m2 = net.last[0].offset_and_mask(last_in)     # at H/4 resolution
    net.train()
    H4, W4 = off2.shape[2:]
    ink = img[0].clamp_min(0) ** 2
    ys, xs = torch.meshgrid(torch.arange(ink.shape[0]), torch.arange(ink.shape[1]), indexing="ij")
    cy, cx = (ink * ys).sum() / ink.sum(), (ink * xs).sum() / ink.sum()
    uy = int(min(H4 - 1, max(0, round((cy.item() - 1.5) / 4))))
    ux = int(min(W4 - 1, max(0, round((cx.item() - 1.5) / 4))))
    # A k3 s2 p1 conv's output o is centred on input 2o: map H/4 -> H/2 -> H coordinates by doubling.
    to_in = lambda y: 2 * y  # noqa: E731
    unit = (to_in(to_in(uy)), to_in(to_in(ux)))
    level2, level1 = [], []
    H2, W2 = off1.shape[2:]
    for t in range(9):
        i, j = divmod(t, 3)
        y2 = uy - 1 + i + off2[0, 2 * t, uy, ux].item()
        x2 = ux - 1 + j + off2[0, 2 * t + 1, uy, ux].item()
        w2 = m2[0, t, uy, ux].item()
        level2.append((to_in(to_in(y2)), to_in(to_in(x2)), w2))
        # First DCN layer at that point (H/2 resolution, nearest unit).
        py = int(min(H2 - 1, max(0, round(2 * y2))))
        px = int(min(W2 - 1, max(0, round(2 * x2))))
        for s in range(9):
            a, b = divmod(s, 3)
            y1 = py - 1 + a + off1[0, 2 * s, py, px].item()
            x1 = px - 1 + b + off1[0, 2 * s + 1, py, px].item()
            level1.append((to_in(y1), to_in(x1), w2 * m1[0, s, py, px].item()))
    return unit, level2, level1


def draw_figures(out_dir, dcn, plain_result, dcn_result, xte, yte, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    os.makedirs(out_dir, exist_ok=True)
    k = 4
    fig, axes = plt.subplots(1, k, figsize=(3.2 * k, 3.6))
    for ax, idx in zip(axes, range(k)):
        img = xte[idx].to(device)
        unit, lvl2, lvl1 = sampling_points(dcn, img)
        ax.imshow(img[0].cpu(), cmap="gray", interpolation="nearest")
        y1, x1, w1 = zip(*lvl1)
        ax.scatter(x1, y1, s=[6 + 30 * w for w in w1], c="red", alpha=0.7, label="layer 1 taps (81)")
        y2, x2, w2 = zip(*lvl2)
        ax.scatter(x2, y2, s=[20 + 60 * w for w in w2], c="gold", edgecolors="black", label="layer 2 taps (9)")
        ax.scatter([unit[1]], [unit[0]], s=120, marker="+", c="lime", linewidths=2, label="output unit")
        ax.set_title(f"'{CLASSES[yte[idx]]}'")
        ax.set_xlim(-0.5, img.shape[-1] - 0.5)
        ax.set_ylim(img.shape[-2] - 0.5, -0.5)
        ax.axis("off")
    axes[0].legend(loc="lower left", fontsize=7, framealpha=0.8)
    fig.suptitle("Where DCNv2 looks: learned sampling locations of one output unit (size = mask)")
    fig.tight_layout()
    sampling_png = os.path.join(out_dir, "sampling_locations.png")
    fig.savefig(sampling_png, dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in (plain_result, dcn_result):
        ep = range(1, len(r.train_loss) + 1)
        a1.plot(ep, r.train_loss, marker="o", label=r.name)
        a2.plot(ep, [100 * a for a in r.test_acc], marker="o", label=r.name)
    a1.set(xlabel="epoch", ylabel="train loss", title="training loss")
    a2.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for a in (a1, a2):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    curves_png = os.path.join(out_dir, "training_curves.png")
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)
    return sampling_png, curves_png


# --- the command ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=positive_int, default=3, help="training epochs per net (default: 3)")
    parser.add_argument("--size", type=positive_int, default=32, help="image side in pixels, >= 16 (default: 32)")
    parser.add_argument("--train", type=positive_int, default=3000, help="training images (default: 3000)")
    parser.add_argument("--test", type=positive_int, default=1000, help="test images (default: 1000)")
    parser.add_argument("--width", type=positive_int, default=12,
                        help="channels of the first DCN-net layer (default: 12)")
    parser.add_argument("--batch", type=positive_int, default=64, help="batch size (default: 64)")
    parser.add_argument("--lr", type=positive_float, default=3e-3,
                        help="peak learning rate (default: 3e-3; x0.1 for offsets)")
    parser.add_argument("--seed", type=int, default=0, help="data, init and order seed (default: 0)")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--out", default="deformconv-demo", help="folder for the PNGs (default: ./deformconv-demo/)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they are drawn on a terminal only)")


def run(args: argparse.Namespace) -> int:
    if args.size < 16:
        raise SystemExit(f"deformconv demo: error: --size must be at least 16, got {args.size}")
    device = default_device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    print(f"deformconv demo: {len(CLASSES)} glyph classes under random scale, rotation, shear, translation and "
          f"elastic warps; {args.train} train / {args.test} test images of {args.size}x{args.size}; device {device}")
    xtr, ytr = make_glyphs(args.train, args.size, seed=args.seed)
    xte, yte = make_glyphs(args.test, args.size, seed=args.seed + 10_000)
    data = (xtr, ytr, xte, yte)
    torch.manual_seed(args.seed)
    plain, dcn = build_nets(args.width)
    progress = not args.no_progress
    results = []
    for name, net in (("plain", plain), ("DCNv2", dcn)):
        torch.manual_seed(args.seed)
        results.append(train(name, net, data, args.epochs, args.batch, args.lr, device, args.seed, progress))
    print()
    print("| net   | parameters | test accuracy | test loss | final train loss | wall time |")
    print("|-------|-----------:|--------------:|----------:|-----------------:|----------:|")
    for r in results:
        print(f"| {r.name:<5} | {r.params:>10,} | {r.test_acc[-1]:>13.1%} | {r.test_loss:>9.3f} | "
              f"{r.train_loss[-1]:>16.3f} | {r.seconds:>8.1f}s |")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\nmatplotlib is not installed: no pictures (pip install 'deformconv[plot]')")
        return 0
    pngs = draw_figures(args.out, dcn, results[0], results[1], xte, yte, device)
    print(f"\nwrote {pngs[0]} (where the DCNv2 net looks) and {pngs[1]} (training curves)")
    return 0
