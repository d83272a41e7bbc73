#!/usr/bin/env python3
"""Timings of tfgc's CUDA kernels on a GPU machine (no TensorFlow).

Runs the TensorFlow-free launchers of libtfgc_cuda.so (built by build.sh) on
device buffers that PyTorch allocates, timed with CUDA events on PyTorch's
current stream, and sets each figure beside two baselines measured in the
same run:

* ``copy``: a device-to-device copy of the kernel's input bytes, the memory
  floor of any single pass over the gradient;
* where PyTorch has the same operation, PyTorch's own (``torch.topk`` on
  |x + r| plus the residual update for top-k; a comparison + bit packing in
  PyTorch ops for the sign bits; a scatter-add for the sparse decode; for
  the block Hadamard rotation, which PyTorch lacks, the product of the
  signed blocks with the dense float32 Hadamard matrix, as a model without a
  transform kernel computes it).

Each figure is the median of ``--repeats`` timed calls after warm-up calls.
Prints a Markdown table; ``--json PATH`` writes the figures too.

    python3 custom_ops/cuda_harness/bench.py [--lib PATH] [--sizes 1048576 16777216]
"""

import argparse
import ctypes
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                      "build", "cuda_harness", "libtfgc_cuda.so"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24, 1 << 26])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch  # the GPU image has it; this machine's CI never runs this file

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 baselines stay float32

    if not torch.cuda.is_available():
        print("bench: no CUDA device", file=sys.stderr)
        return 2
    lib = ctypes.CDLL(args.lib)
    vp, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.tfgc_cuda_pack_sign_bits.argtypes = [c_int, vp, i64, vp, vp]
    lib.tfgc_cuda_onebit_quantize_scratch_bytes.argtypes = [i64, i64]
    lib.tfgc_cuda_onebit_quantize_scratch_bytes.restype = i64
    lib.tfgc_cuda_onebit_quantize.argtypes = [c_int, vp, i64, i64, vp, vp, vp, vp, vp, vp]
    lib.tfgc_cuda_quantize_bucketed_scratch_bytes.argtypes = [i64, i64]
    lib.tfgc_cuda_quantize_bucketed_scratch_bytes.restype = i64
    lib.tfgc_cuda_quantize_bucketed.argtypes = [c_int, vp, i64, i64, c_int, c_int, c_int, i64,
                                                i64, vp, vp, vp, vp]
    lib.tfgc_cuda_sparsify_scratch_bytes.argtypes = [i64]
    lib.tfgc_cuda_sparsify_scratch_bytes.restype = i64
    lib.tfgc_cuda_sparsify_topk.argtypes = [c_int, vp, vp, i64, i64, vp, vp, vp, vp, vp, vp]
    lib.tfgc_cuda_threshold_encode_scratch_bytes.argtypes = [i64]
    lib.tfgc_cuda_threshold_encode_scratch_bytes.restype = i64
    lib.tfgc_cuda_threshold_encode_count.argtypes = [c_int, vp, vp, i64, f32, f32, vp, vp,
                                                     ctypes.POINTER(ctypes.c_int64), vp]
    lib.tfgc_cuda_threshold_encode_emit.argtypes = [vp, i64, vp, vp]
    lib.tfgc_cuda_scatter_add_scratch_bytes.argtypes = [c_int, i64]
    lib.tfgc_cuda_scatter_add_scratch_bytes.restype = i64
    lib.tfgc_cuda_scatter_add.argtypes = [c_int, vp, vp, i64, i64, vp, vp, vp]
    lib.tfgc_cuda_block_hadamard.argtypes = [vp, vp, i64, i64, c_int, vp, vp]

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)

    def ok(err, what):
        if err != 0:
            raise RuntimeError(f"{what}: cudaError {err}")

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def empty(nbytes):
        return torch.empty(max(8, int(nbytes)), dtype=torch.uint8, device=dev)

    rows = []

    def row(kernel, n, ms, copy_ms, base_name=None, base_ms=None):
        rows.append({"kernel": kernel, "n": n, "ms": ms, "copy_ms": copy_ms,
                     "baseline": base_name, "baseline_ms": base_ms})

    weights = 1 << torch.arange(32, device=dev, dtype=torch.int64)
    for n in args.sizes:
        g = torch.randn(n, device=dev)
        r = torch.randn(n, device=dev) * 0.1
        dst = torch.empty_like(g)
        copy_ms = timed(lambda: dst.copy_(g))

        # Sign bits (onebit / signSGD's wire format).
        words = empty(4 * -(-n // 32))
        ms = timed(lambda: ok(lib.tfgc_cuda_pack_sign_bits(0, g.data_ptr(), n, words.data_ptr(),
                                                           sp), "pack"))

        def torch_pack():
            bits = (g >= 0).to(torch.int64)
            pad = (-n) % 32
            if pad:
                bits = torch.nn.functional.pad(bits, (0, pad))
            return (bits.view(-1, 32) * weights).sum(dim=1).to(torch.int32)

        row("pack_sign_bits", n, ms, copy_ms, "torch compare+pack", timed(torch_pack))

        # 1-bit SGD: per-column means, signs and residual, on a [n/1024, 1024] matrix.
        cols = 1024
        rws = n // cols
        scratch = empty(lib.tfgc_cuda_onebit_quantize_scratch_bytes(rws, cols))
        pm, nm, res = empty(4 * cols), empty(4 * cols), torch.empty_like(g)
        ms = timed(lambda: ok(lib.tfgc_cuda_onebit_quantize(
            0, g.data_ptr(), rws, cols, words.data_ptr(), pm.data_ptr(), nm.data_ptr(),
            res.data_ptr(), scratch.data_ptr(), sp), "onebit"))
        row("onebit_quantize", n, ms, copy_ms)

        # QSGD 4-bit (levels 7, bucket 128, l2 norm).
        bucket, bits, levels = 128, 4, 7
        nb = -(-n // bucket)
        scratch = empty(lib.tfgc_cuda_quantize_bucketed_scratch_bytes(n, bucket))
        scales, qwords = empty(4 * nb), empty(4 * -(-n // (32 // bits)))
        ms = timed(lambda: ok(lib.tfgc_cuda_quantize_bucketed(
            0, g.data_ptr(), n, bucket, levels, bits, 0, 1, 2, scratch.data_ptr(),
            scales.data_ptr(), qwords.data_ptr(), sp), "qsgd"))
        row("quantize_bucketed (qsgd 4-bit)", n, ms, copy_ms)

        # Top-k with error feedback (0.1 % and 1 %).
        sscratch = empty(lib.tfgc_cuda_sparsify_scratch_bytes(n))
        new_res = torch.empty_like(g)
        for ratio in (0.001, 0.01):
            k = max(1, int(n * ratio))
            vals, idx = empty(4 * k), empty(4 * k)
            ms = timed(lambda: ok(lib.tfgc_cuda_sparsify_topk(
                0, g.data_ptr(), r.data_ptr(), n, k, sscratch.data_ptr(), new_res.data_ptr(),
                vals.data_ptr(), idx.data_ptr(), None, sp), "topk"))

            def torch_topk():
                v = g + r
                _, top = torch.topk(v.abs(), k, sorted=False)
                sent = v[top]
                v[top] = 0
                return sent, top

            row(f"sparsify_topk {ratio:.1%}", n, ms, copy_ms, "torch.topk + residual",
                timed(torch_topk))

        # Strom's threshold encode (tau = 2: about 4.6 % of N(0,1) sent).
        tscratch = empty(lib.tfgc_cuda_threshold_encode_scratch_bytes(n))
        count = ctypes.c_int64()
        twords = empty(4 * n)

        def encode():
            ok(lib.tfgc_cuda_threshold_encode_count(0, g.data_ptr(), r.data_ptr(), n, 2.0, -2.0,
                                                    new_res.data_ptr(), tscratch.data_ptr(),
                                                    ctypes.byref(count), sp), "encode_count")
            ok(lib.tfgc_cuda_threshold_encode_emit(tscratch.data_ptr(), n, twords.data_ptr(), sp),
               "encode_emit")

        row("threshold_encode (tau 2)", n, timed(encode), copy_ms)

        # Sparse decode of 4 workers' 1 % payloads.
        m = 4 * max(1, n // 100)
        values = torch.randn(m, device=dev)
        indices = torch.randint(0, n, (m,), device=dev, dtype=torch.int32)
        ascratch = empty(lib.tfgc_cuda_scatter_add_scratch_bytes(0, n))
        out = torch.empty_like(g)
        ms = timed(lambda: ok(lib.tfgc_cuda_scatter_add(
            0, values.data_ptr(), indices.data_ptr(), m, n, ascratch.data_ptr(), out.data_ptr(),
            sp), "scatter_add"))
        idx64 = indices.long()
        row("scatter_add (4 x 1 %)", n, ms, copy_ms, "torch index_add_",
            timed(lambda: torch.zeros_like(g).index_add_(0, idx64, values)))

        # The randomized block Hadamard rotation (rotated QSGD's blocks of 128 and
        # 512; 65536 runs the passes past the 4096-element tile over global memory).
        hout = torch.empty_like(g)
        for block in (128, 512, 1 << 16):
            if n % block:
                continue
            signs = torch.where(torch.rand(block, device=dev) < 0.5, -1.0, 1.0)
            ms = timed(lambda: ok(lib.tfgc_cuda_block_hadamard(
                g.data_ptr(), signs.data_ptr(), n, block, 0, hout.data_ptr(), sp), "hadamard"))
            base_name = base_ms = None
            if block <= 4096:
                h = torch.ones(1, 1, device=dev)
                while h.shape[0] < block:
                    h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
                h = h / block ** 0.5
                base_name = "torch matmul by H_m"
                base_ms = timed(lambda: torch.matmul(g.view(-1, block) * signs, h))
            row(f"block_hadamard (block {block})", n, ms, copy_ms, base_name, base_ms)
        del g, r, dst, res, new_res, out, hout
        torch.cuda.empty_cache()

    print(f"GPU: {torch.cuda.get_device_name()}; median of {args.repeats} calls, ms; "
          "copy = device-to-device copy of the float32 input")
    print("| kernel | n | tfgc ms | GB/s of input | copy ms | baseline | baseline ms | "
          "baseline / tfgc |")
    print("|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        gbs = 4 * r_["n"] / (r_["ms"] * 1e6)
        base = (f"{r_['baseline']} | {r_['baseline_ms']:.3f} | "
                f"{r_['baseline_ms'] / r_['ms']:.2f}×" if r_["baseline"] else "– | – | –")
        print(f"| {r_['kernel']} | {r_['n']:,} | {r_['ms']:.3f} | {gbs:.0f} | "
              f"{r_['copy_ms']:.3f} | {base} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
