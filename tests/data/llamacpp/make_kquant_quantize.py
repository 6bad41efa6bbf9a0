import ctypes, numpy as np, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.ggml_quantize_init.argtypes = [ctypes.c_int]
rng = np.random.default_rng(22)
rows, cols = 16, 512
w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
w[3, ::7] *= 8  # outliers
w[4] = np.abs(w[4])  # all positive
w[5] = -np.abs(w[5]) - 0.5  # all negative
w[6] = rng.standard_t(3, cols).astype(np.float32)  # heavy tails
imat = rng.uniform(0.001, 3, cols).astype(np.float32)
out = {"w": w, "imatrix": imat}
for name, t, nbytes in (("q2_k", 10, 84), ("q3_k", 11, 110), ("q4_k", 12, 144), ("q5_k", 13, 176), ("q6_k", 14, 210)):
    lib.ggml_quantize_init(t)
    for tag, im in (("", None), ("_imatrix", imat)):
        dst = np.zeros((rows, cols // 256 * nbytes), np.uint8)
        n = lib.ggml_quantize_chunk(t, w.ctypes.data, dst.ctypes.data, 0, rows, cols, None if im is None else im.ctypes.data)
        assert n == dst.size, (n, dst.size)
        out[name + tag] = dst
np.savez_compressed(sys.argv[2], **out)
print({k: v.shape for k, v in out.items()})
