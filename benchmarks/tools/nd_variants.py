"""N-d: the launch's tap rows and the TF32 products, side by side (deformconv rows; dense once)."""
import sys, json
sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench, do_bench_cudagraph
import bench_deform_conv_nd as B
from deformconv.ops.deform_conv_nd import triton as K
torch.backends.cudnn.benchmark = True
variants = {"rows+tf32": (4, True), "tap+tf32": (10**9, True), "rows+fp32": (4, False), "tap+fp32 (before)": (10**9, False)}
rows = []
for load in B.LOADS:
    for dt in ("float32", "bfloat16"):
        dtype = getattr(torch, dt)
        leaves = B._inputs(load, dtype)
        calls = B._calls(load)
        names = ["dense"] + list(variants) if dt == "float32" else ["dense", "rows+tf32", "tap+tf32"]
        for v in names:
            fn = calls["dense" if v == "dense" else "deformconv"]
            rp, tf = variants.get(v, (4, True))
            K.ROW_PROGRAMS = rp
            torch.backends.cudnn.allow_tf32 = tf
            out = fn(*leaves); gout = torch.randn_like(out)
            need = [leaves[0], leaves[2], leaves[3]] if v == "dense" else leaves
            fb = lambda: torch.autograd.grad(fn(*leaves), need, gout)
            r = dict(load=load, dtype=dt, variant=v,
                     fwd_graph_ms=do_bench_cudagraph(lambda: fn(*leaves), return_mode="median"),
                     fb_graph_ms=do_bench_cudagraph(fb, return_mode="median"),
                     fb_ms=do_bench(fb, return_mode="median"))
            rows.append(r); print(json.dumps(r), flush=True)
K.ROW_PROGRAMS = 4; torch.backends.cudnn.allow_tf32 = True
print("| load | dtype | variant | fwd graph | fwd+bwd graph | fwd+bwd eager |")
for r in rows:
    print(f"| {r['load']} | {r['dtype']} | {r['variant']} | {r['fwd_graph_ms']:.3f} | {r['fb_graph_ms']:.3f} | {r['fb_ms']:.3f} |")
