"""A pure-torch reference of qattn's KV-cache decode (docs/kv-cache.md), for the tests.

dequantize() reads a cache's pool byte by byte as the format page says (sections,
head slices, rows; E2M1 nibbles, E4M3 bytes, little-endian FP32 and BF16 decoded with
torch integer ops, no float8 dtype), and decode_reference() is the attention over it in
float64: Q rounded to BF16 (as it enters the kernel), scores against the cached K - c,
the bottom-right causal mask, and the LSE with sm_scale * q.c folded back. It works on
the cache's device (CPU or CUDA). The library's decode equals its CPU emulation to FP32
rounding, and the emulation is this in FP32, so the tolerances below bound the
difference.

write_tokens() is a test aid that fills a (CPU) cache without the GPU append: a torch
quantizer close to qattn's (same formats and scale rules, but ties of the E2M1 rounding
and the sampled mean are not guaranteed to match it bit for bit), used only to check
this reference on the CPU.
"""

import math

import torch

NVFP4, FP8, INT8, BF16 = "nvfp4", "fp8", "int8", "bf16"
FORMATS = (NVFP4, FP8, INT8, BF16)

# ---- tolerances, derived from the formats ---------------------------------------------

# The output of the kernel against decode_reference (the same dequantized cache):
#   |o - o_ref| <= OUT_ROUNDING[dtype] * |o_ref| + FP32_SLACK * max|v_hat|   (elementwise)
# OUT_ROUNDING: o is rounded once to its dtype, RNE to 8 (bf16) or 11 (fp16) significant
# bits: a relative error of at most 2^-8 or 2^-11.
# FP32_SLACK: the FP32 arithmetic before that rounding. A score x = sum_c q_c k_c, d
# terms, errs by at most d * 2^-24 * sum_c |q_c k_c| * sm_scale * log2(e); at d = 128 on
# Gaussian q, k (sum |q k| ~ 0.64 d) that is ~8e-5 in log2 units, so a softmax weight
# errs by ~1.1e-4 relative and o by ~1.1e-4 * max|v_hat| at worst; the FP32 sums over
# the keys and the split merge add ~L * 2^-24 relative at worst (1e-4 at L = 1600, far
# less in practice). 2^-12 = 2.4e-4 covers both with a factor ~2.
OUT_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_SLACK = 2.0**-12
# The natural-log LSE against the reference: the score error above (~1e-4 natural),
# log2 of the FP32 sum, FP32 rounding of an LSE of magnitude <= 30 (2e-6), and the FP32
# sum sm_scale * q.c, d * 2^-24 * sm_scale * sum_c |q_c||c_c| ~ 5e-4 where c holds a K
# bias of 8 standard deviations per channel (|c_c| ~ 6.4 on average), the largest these
# tests use. 2e-3 covers their sum with a factor ~2.
LSE_ATOL = 2e-3

# CosSim of the decode to torch SDPA in float64 on the unquantized K and V, Gaussian
# inputs. CosSim = 1 - eps^2 / 2 for a relative RMS output error eps, and eps combines
# V's relative element error with K's (a score error sm_scale * q . dk moves the softmax
# weights by the same relative amount), eps ~ sqrt(eps_v^2 + eps_k^2):
#   NVFP4: E2M1 has 1 mantissa bit on a 16-element block scale E4M3(amax/6): relative
#     RMS element error ~0.1 on Gaussian blocks, eps ~0.13, CosSim ~0.992 (the CPU
#     emulation predicts 0.9905 on Gaussian K with a bias, smoothed,
#     bench/results/kv-cache-accuracy-emulated.txt; this reference, on the shapes of
#     these tests, 0.9902..0.9948 over 24 draws). A bound at the mean would fail on a
#     fraction of fresh draws, so it allows eps <= 0.17: 0.985.
#   FP8 E4M3: 3 mantissa bits, relative RMS ~2^-3 ln2 / sqrt(12) = 0.025 per element,
#     eps ~0.035, CosSim ~0.9994 (emulation 0.99930; here 0.99928..0.9996); bound
#     eps <= 0.045: 0.999.
#   INT8: per-row step amax/127 ~ 2.6 sigma / 127, RMS step/sqrt(12) = 0.006 sigma,
#     eps ~0.009, CosSim ~0.99996 (emulation 0.999957; here >= 0.99994); bound
#     eps <= 0.032: 0.9995.
#   BF16: 8 significant bits, relative RMS 2^-9/sqrt(3) ~ 1.1e-3 per element (K - c is
#     rounded once more), plus the output's rounding, eps ~2e-3, CosSim ~0.999998;
#     bound eps <= 4.5e-3: 0.99999.
MIN_COSSIM = {NVFP4: 0.985, FP8: 0.999, INT8: 0.9995, BF16: 0.99999}

# ---- layout ---------------------------------------------------------------------------


def row_bytes(fmt, d):
    """(code bytes C, scale bytes G) of one row (docs/kv-cache.md, Element formats)."""
    return {NVFP4: (d // 2, d // 16), FP8: (d, 4), INT8: (d, 4), BF16: (2 * d, 0)}[fmt]


def align16(x):
    return (x + 15) // 16 * 16


def page_layout(fmt, heads_kv, d, page_size):
    """The byte offsets of a page's sections, as docs/kv-cache.md's table gives them."""
    c, g = row_bytes(fmt, d)
    hc, hg = align16(page_size * c), align16(page_size * g)
    return dict(C=c, G=g, HC=hc, HG=hg, k_codes=0, v_codes=heads_kv * hc,
                k_scales=2 * heads_kv * hc, v_scales=2 * heads_kv * hc + heads_kv * hg,
                page_bytes=2 * heads_kv * (hc + hg))


def _row_offsets(cache, seq, length, section, width, per_head):
    """Byte offsets (Hkv, L, width) of the rows of tokens [0, length) of seq in one
    section, from the host block table."""
    dev = cache.pages.device
    lay = page_layout(cache.format, cache.heads_kv, cache.head_dim, cache.page_size)
    t = torch.arange(length, device=dev)
    table = cache.host_block_tables[seq].to(dev).long()
    page = table[t // cache.page_size]
    assert (page >= 0).all(), f"sequence {seq}: a token without a page"
    slot = t % cache.page_size
    h = torch.arange(cache.heads_kv, device=dev)
    base = page * lay["page_bytes"] + lay[section] + slot * width  # (L,)
    return (base[None, :, None] + h[:, None, None] * per_head
            + torch.arange(width, device=dev)[None, None, :])


def row_bytes_of(cache, seq, length=None):
    """The raw bytes of seq's tokens: {"k_codes", "v_codes", "k_scales", "v_scales"},
    each uint8 (Hkv, L, width)."""
    length = int(cache.lengths[seq]) if length is None else length
    lay = page_layout(cache.format, cache.heads_kv, cache.head_dim, cache.page_size)
    out = {}
    for what in ("k", "v"):
        out[f"{what}_codes"] = cache.pages[_row_offsets(cache, seq, length, f"{what}_codes", lay["C"], lay["HC"])]
        if lay["G"]:
            out[f"{what}_scales"] = cache.pages[_row_offsets(cache, seq, length, f"{what}_scales",
                                                             lay["G"], lay["HG"])]
    return out


# ---- element decoders (integer ops) ----------------------------------------------------


def e4m3_decode(codes):
    """OCP E4M3 bytes -> float32: bias 7, 3 mantissa bits, subnormal step 2^-9, NaN for
    S.1111.111."""
    c = codes.to(torch.int32)
    sign = (c >> 7) & 1
    field = (c >> 3) & 0xF
    man = c & 0x7
    normal = torch.ldexp((8 + man).to(torch.float32), (field - 10).to(torch.float32))
    sub = torch.ldexp(man.to(torch.float32), torch.full_like(man, -9, dtype=torch.float32))
    mag = torch.where(field == 0, sub, normal)
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, math.nan), mag)
    return torch.where(sign == 1, -mag, mag)


def e2m1_decode(nibbles):
    """E2M1 codes (low 4 bits) -> float32: bit 3 the sign, magnitudes 0, .5, 1, 1.5, 2,
    3, 4, 6."""
    c = nibbles.to(torch.int32) & 0xF
    sign = (c >> 3) & 1
    field = (c >> 1) & 0x3
    man = c & 1
    normal = torch.ldexp((2 + man).to(torch.float32), (field - 2).to(torch.float32))
    mag = torch.where(field == 0, man.to(torch.float32) * 0.5, normal)
    return torch.where(sign == 1, -mag, mag)


def _int32_bits_to_float(bits64):
    """float32 of the 32-bit patterns held in an int64 tensor."""
    wrapped = torch.where(bits64 >= 2**31, bits64 - 2**32, bits64)
    return wrapped.to(torch.int32).view(torch.float32)


def f32_from_le(b):
    """Little-endian FP32 from its 4 bytes along the last dimension."""
    b = b.to(torch.int64)
    return _int32_bits_to_float(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24))


def bf16_from_le(b):
    """Little-endian bfloat16 from pairs of bytes along the last dimension (2n -> n)."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 2)
    return _int32_bits_to_float((b[..., 0] | (b[..., 1] << 8)) << 16)


def dequantize(cache, seq, length=None):
    """(k_hat, v_hat, c): the cached K - c and V of seq's tokens, (Hkv, L, d) float32
    (code value x scale, one FP32 product), and c (Hkv, d) float32."""
    raw = row_bytes_of(cache, seq, length)
    d = cache.head_dim
    out = []
    for what in ("k", "v"):
        codes = raw[f"{what}_codes"]
        if cache.format == NVFP4:
            lo, hi = codes & 0xF, codes >> 4  # element 2i low nibble, 2i + 1 high
            values = e2m1_decode(torch.stack((lo, hi), dim=-1).reshape(*codes.shape[:-1], d))
            scales = e4m3_decode(raw[f"{what}_scales"]).repeat_interleave(16, dim=-1)
            out.append(values * scales)
        elif cache.format == FP8:
            out.append(e4m3_decode(codes) * f32_from_le(raw[f"{what}_scales"])[..., None])
        elif cache.format == INT8:
            out.append(codes.view(torch.int8).to(torch.float32) * f32_from_le(raw[f"{what}_scales"])[..., None])
        else:
            out.append(bf16_from_le(codes))
    return out[0], out[1], cache.k_mean[seq].to(torch.float32)


# ---- attention --------------------------------------------------------------------------


def _attend(q, k, v, causal, scale, shift=None):
    """float64 attention of q (Hq, nq, d) on k, v (Hkv, L, d) with GQA and the causal
    mask aligned bottom-right; shift (Hq, nq) is added to the LSE. Rows that see no key
    give o = 0 and lse = -inf."""
    hq, nq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=0)
    v = v.repeat_interleave(hq // hkv, dim=0)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(length, device=q.device)[None, :]
        s = s.masked_fill(j > i + (length - nq), -math.inf)
    if length > 0:
        lse = torch.logsumexp(s, dim=-1)
        o = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v
    else:
        lse = torch.full((hq, nq), -math.inf, dtype=q.dtype, device=q.device)
        o = q.new_zeros(hq, nq, v.shape[-1])
    if shift is not None:
        lse = lse + shift
    return o, lse


def decode_reference(q, cache, seqs=None, causal=True, sm_scale=None):
    """(o, lse) in float64 of qattn.decode(q, cache, seqs, causal, sm_scale) computed
    from the cache's bytes: q (B, Hq, nq, d) -> o (B, Hq, nq, d), lse (B, Hq, nq)."""
    b = q.shape[0]
    seqs = list(range(b)) if seqs is None else list(seqs)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qb = q.to(torch.bfloat16).to(torch.float64)
    outs, lses = [], []
    for i, s in enumerate(seqs):
        k, v, c = dequantize(cache, s)
        k, v, c = (t.to(device=q.device, dtype=torch.float64) for t in (k, v, c))
        group = q.shape[1] // cache.heads_kv
        qc = (qb[i] * c.repeat_interleave(group, dim=0)[:, None, :]).sum(-1)  # (Hq, nq)
        o, lse = _attend(qb[i], k, v, causal, scale, shift=scale * qc)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def sdpa_reference(q, ks, vs, causal=True, sm_scale=None):
    """float64 attention of q (B, Hq, nq, d) on each batch entry's own unquantized K and V
    (lists of (Hkv, L_b, d)), the mask aligned bottom-right: what the cache approximates."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs = [_attend(q[i].double(), k.double(), v.double(), causal, scale) for i, (k, v) in enumerate(zip(ks, vs))]
    return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])


def cossim(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def assert_matches_reference(o, lse, o_ref, lse_ref, v_max, what=""):
    """The kernel's (o, lse) against decode_reference within the bounds above."""
    tol = OUT_ROUNDING[o.dtype] * o_ref.abs() + FP32_SLACK * v_max
    err = (o.double() - o_ref).abs()
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (
        f"{what}: |o - ref| = {err.flatten()[worst].item():.3g} > {tol.flatten()[worst].item():.3g} "
        f"at flat index {worst.item()} (o {o.flatten()[worst].item():.6g}, ref {o_ref.flatten()[worst].item():.6g})")
    if lse is not None:
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE finite where the reference is not"
        assert (lse[~finite] == -math.inf).all(), f"{what}: an empty row's LSE is not -inf"
        lerr = (lse.double() - lse_ref)[finite].abs()
        worst_lse = lerr.max().item() if lerr.numel() else 0.0
        assert worst_lse <= LSE_ATOL, f"{what}: LSE error {worst_lse:.3g} > {LSE_ATOL}"


# ---- a torch writer, for checking the reference on the CPU ----------------------------------


def _e4m3_encode(x):
    """RNE to E4M3 with saturation at 448 (torch's float8 cast rounds to nearest even)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_encode(y):
    """The nearest E2M1 code of y (saturating at 6); ties go to the lower magnitude."""
    mid = (_E2M1_MAGNITUDES[1:] + _E2M1_MAGNITUDES[:-1]) / 2
    code = torch.bucketize(y.abs(), mid.to(y.device), right=False).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def quantize_rows(x, fmt):
    """(codes (N, C), scales (N, G)) uint8 of rows x (N, d) float32, per the format table."""
    n, d = x.shape
    if fmt == NVFP4:
        blocks = x.reshape(n, d // 16, 16)
        sc = _e4m3_encode(blocks.abs().amax(-1) / 6.0)
        s = e4m3_decode(sc)[..., None]
        y = torch.where(s > 0, blocks / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(blocks))
        codes = _e2m1_encode(y).reshape(n, d)
        return codes[:, 0::2] | (codes[:, 1::2] << 4), sc
    if fmt == BF16:
        bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        codes = torch.stack((bits & 0xFF, bits >> 8), dim=-1).reshape(n, 2 * d).to(torch.uint8)
        return codes, x.new_zeros(n, 0, dtype=torch.uint8)
    amax = x.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if fmt == FP8:
        codes = torch.where(amax > 0, _e4m3_encode(x * (448.0 / safe)), torch.zeros_like(x, dtype=torch.uint8))
        scale = amax / 448.0
    else:
        codes = torch.where(amax > 0, torch.round(x * (127.0 / safe)).clamp(-127, 127), torch.zeros_like(x))
        codes = codes.to(torch.int8).view(torch.uint8)
        scale = amax / 127.0
    return codes, scale.to(torch.float32).view(torch.uint8).reshape(n, 4)


def write_tokens(cache, seq, k, v):
    """Appends k, v (Hkv, n, d) to seq of a CPU cache as the format page describes (the
    first append of a smoothed sequence fixes c: the mean of its keys over the
    256-token sample). Pages must be assigned. For the reference's own tests."""
    lay = page_layout(cache.format, cache.heads_kv, cache.head_dim, cache.page_size)
    length = int(cache.lengths[seq])
    n = k.shape[1]
    k, v = k.float(), v.float()
    if cache.smoothing and length == 0:
        sample = torch.arange(n) if n <= 256 else torch.tensor([i * n // 256 for i in range(256)])
        cache.k_mean[seq] = k[:, sample].double().mean(1).float()
    if cache.smoothing:
        k = k - cache.k_mean[seq][:, None, :]
    for what, x in (("k", k), ("v", v)):
        codes, scales = quantize_rows(x.reshape(-1, cache.head_dim), cache.format)
        codes = codes.reshape(cache.heads_kv, n, -1)
        scales = scales.reshape(cache.heads_kv, n, -1)
        total = length + n
        off = _row_offsets(cache, seq, total, f"{what}_codes", lay["C"], lay["HC"])[:, length:]
        cache.pages[off] = codes
        if lay["G"]:
            off = _row_offsets(cache, seq, total, f"{what}_scales", lay["G"], lay["HG"])[:, length:]
            cache.pages[off] = scales
    cache._host_lengths[seq] = length + n
    cache.device_lengths[seq] = length + n
